"""Closed-loop evaluation beside training: the trainer's side (TRAINING.md, "Closed-loop evaluation
during training"). Rank 0 only; elsewhere, or with `evaluation.task` null, every method does nothing.

    evaluator = Evaluator(cfg, run_dir, metrics, dist.is_main())   # after Metrics
    evaluator.after_save(step, path)     # after each save: starts the evaluation of a due checkpoint
    evaluator.poll()                     # at each logged step: logs the evaluations that ended
    evaluator.close(preempted)           # at the end: waits for the last one; on preemption stops it

With `evaluation.runner: trainer`, a save at a multiple of `evaluation.interval` (or at the run's
last step) starts `python -m inference.rollout` on that checkpoint as a child process (its output in
`{run_dir}/eval_logs/`), and training goes on. One runs at a time; a due save meanwhile waits for it,
and a newer due save takes the waiting one's place (the older is skipped, and logged): the evaluations
keep up with training instead of falling further behind, and the last checkpoint is always evaluated.
A checkpoint waiting or being evaluated carries checkpoint/evaluations.py's EVALUATING marker (kept
fresh here), so retention never deletes it. With `runner: follower` an external `python -m
inference.follow` job evaluates.

Either way, every poll logs the records in the run's checkpoint folders not yet logged, at their
checkpoint's step: a report as eval/* figures and one episode's video, a failure as eval/error. Which
were logged is read back from metrics.jsonl, so a resumed run logs each once and redoes none. On
preemption the child is stopped with its server and workers and its partial output removed; its marker
stays, and the resumed run evaluates that checkpoint again.
"""
import atexit
import contextlib
import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

import psutil
from omegaconf import DictConfig

from checkpoint import evaluations
from checkpoint.layout import complete_checkpoints, saved_steps
from utils.child import PREEMPTION_SIGNALS, bound_to_parent
from utils.metrics import Metrics

log = logging.getLogger("evaluation")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_DIR = "eval_logs"
STOP_GRACE_S = 30.0  # the rollout stops its server and workers within seconds of a SIGINT
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
               "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def child_env() -> dict[str, str]:
    """The trainer's environment without its launcher's variables (the rollout and its server are
    programs of their own, not ranks of the run), with MuJoCo's headless EGL unless MUJOCO_GL is set."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("TORCHELASTIC_")}
    env.setdefault("MUJOCO_GL", "egl")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Rollout:
    """One `python -m inference.rollout` of a checkpoint, in a session of its own: a Ctrl-C or a signal
    meant for the trainer does not reach it; the trainer stops it (`stop`)."""

    def __init__(self, checkpoint: str, cmd: list[str], log_path: str) -> None:
        self.checkpoint, self.log_path = checkpoint, log_path
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self._log: IO[str] = open(log_path, "a")
        self._log.write(f"$ {' '.join(cmd)}\n")
        self._log.flush()
        # SIGINT if the trainer is killed outright: the rollout stops its server and workers as on stop()
        self.proc = bound_to_parent(cmd, signal.SIGINT, cwd=ROOT, env=child_env(), stdout=self._log,
                                    stderr=subprocess.STDOUT)

    def finished(self) -> bool:
        return self.proc.poll() is not None

    def wait(self) -> None:
        self.proc.wait()
        self._log.close()

    def error(self) -> str | None:
        """None if it ended with a report; else why not, in one line (the last line it printed)."""
        code = self.proc.returncode
        if code == 0 and evaluations.read_report(self.checkpoint) is not None:
            return None
        with open(self.log_path, errors="replace") as f:
            lines = [line.strip() for line in f.readlines()[-100:] if line.strip()]
        if code < 0:
            how = f"signal {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}" if code else "exit code 0 without a report"
        last = lines[-1] if lines else "no output"
        # its own message, and the line that ends what it quotes (a policy server's error)
        failed = next((line for line in reversed(lines) if line.startswith("rollout failed:")), last)
        said = last if failed == last else f"{failed} ... {last}"
        return f"inference.rollout ended with {how}: {said} (log: {self.log_path})"

    def stop(self) -> None:
        """SIGINT to its session: the rollout stops its policy server (a session of its own) and its
        workers and removes its partial report; whatever is left after STOP_GRACE_S is killed."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        deadline = time.monotonic() + STOP_GRACE_S
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(STOP_GRACE_S)
        _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
        if self.proc.poll() is None:
            self.proc.kill()
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)  # a SIGKILL is not ignored: gone at once (a zombie: after 5 s)
        self.wait()


def remove_partial(checkpoint: str) -> None:
    """The temporary report folders a stopped rollout left in `checkpoint` (a whole report is kept)."""
    for partial in glob.glob(os.path.join(checkpoint, evaluations.PARTIAL + "*")):
        shutil.rmtree(partial, ignore_errors=True)


def logged_evaluations(metrics_path: str) -> set[tuple[int, str]]:
    """(step, "report" | "error") of every evaluation record in metrics.jsonl."""
    logged: set[tuple[int, str]] = set()
    if not os.path.exists(metrics_path):
        return logged
    with open(metrics_path) as f:
        for line in f:
            if '"eval/' in line:  # the other records are not parsed
                record = json.loads(line)
                kind = "report" if "eval/success_rate" in record else "error" if "eval/error" in record else None
                if kind:
                    logged.add((record["step"], kind))
    return logged


def figures_of(report: dict[str, Any]) -> dict[str, float | str]:
    """The logged figures of a rollout report (KeyError for a report that lacks one)."""
    policy = report["results"]["policy"]
    low, high = policy["wilson_95"]
    figures: dict[str, float | str] = {
        "eval/success_rate": policy["success_rate"], "eval/success_low": low, "eval/success_high": high,
        "eval/mean_max_reward": policy["mean_max_reward"], "eval/episodes": policy["episodes"]}
    if "latency_ms" in policy:  # absent when no query was answered
        figures["eval/latency_p50_ms"] = policy["latency_ms"]["p50"]
    return figures


class Evaluator:
    def __init__(self, cfg: DictConfig, run_dir: str, metrics: Metrics, enabled: bool) -> None:
        self.cfg, self.run_dir, self.metrics = cfg.evaluation, run_dir, metrics
        self.last_step = cfg.training.max_steps
        self.enabled = enabled and self.cfg.task is not None
        self.running: Rollout | None = None
        self.waiting: str | None = None  # the newest due checkpoint not yet started
        self.logged: set[tuple[int, str]] = set()
        if not self.enabled:
            return
        self.owner = evaluations.default_owner()
        self.logged = logged_evaluations(metrics.path)
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._keep_markers, name="evaluation-heartbeat", daemon=True)
        self._heartbeat.start()
        atexit.register(self._stop_at_exit)  # the trainer died: no rollout outlives it
        if self.cfg.runner == "trainer":
            self._resume_interrupted()

    # ---- the loop's calls ---------------------------------------------------------------------
    def after_save(self, step: int, path: str) -> None:
        """Start (or queue) the evaluation of checkpoint `path` if `step` is due (a multiple of
        evaluation.interval, or the run's last step, as inference.follow decides); never blocks."""
        if not self.enabled or self.cfg.runner != "trainer":
            return
        if step % self.cfg.interval and step != self.last_step:  # not due
            return
        self._reap()
        if evaluations.read_report(path) is not None:  # a rewound run reached a step it evaluated before
            return
        try:
            evaluations.begin_evaluation(path, self.owner)  # retention keeps it while it waits and runs
        except FileNotFoundError:
            log.warning("%s is gone; not evaluated", path)
            return
        if self.running is None:
            self._start(path)
            return
        if self.waiting is not None:
            log.info("%s is not evaluated: %s is newer and waits in its place",
                     os.path.basename(self.waiting), os.path.basename(path))
            evaluations.end_evaluation(self.waiting)
        self.waiting = path
        log.info("%s waits for the evaluation of %s", os.path.basename(path),
                 os.path.basename(self.running.checkpoint))

    def poll(self) -> None:
        """Non-blocking: reap an evaluation that ended (start the waiting one), log every new record."""
        if not self.enabled:
            return
        self._reap()
        self._log_new_records()

    def close(self, preempted: bool) -> None:
        """End of training: wait for the running and the waiting evaluation and log them; on preemption,
        stop the running one (the resumed run evaluates it and the waiting one again)."""
        if not self.enabled:
            return
        self._reap(start_next=not preempted)
        if preempted:
            self._stop_running("the run is preempted")
        while self.running is not None:
            log.info("training is done; waiting for the evaluation of %s (its log: %s)",
                     os.path.basename(self.running.checkpoint), self.running.log_path)
            self.running.wait()
            self._reap()
        self._log_new_records()
        if self.cfg.runner == "follower":
            log.info("the follower's reports that land from now on stay in the checkpoint folders "
                     "(eval/report.json); this run no longer logs them")
        self._stop_heartbeat.set()
        atexit.unregister(self._stop_at_exit)

    # ---- the child ----------------------------------------------------------------------------
    def _start(self, checkpoint: str) -> None:
        if not os.path.isdir(checkpoint):
            log.warning("%s is gone; not evaluated", checkpoint)
            return
        remove_partial(checkpoint)  # an interrupted rollout's, before a new one writes there
        cmd = evaluations.rollout_command(checkpoint, self.cfg, sys.executable)
        try:
            self.running = Rollout(checkpoint, cmd, os.path.join(self.run_dir, LOG_DIR,
                                                                 os.path.basename(checkpoint) + ".log"))
        except OSError as e:  # no process could be started (out of memory, process limit)
            self._failed(checkpoint, f"inference.rollout could not be started: {e}")
            evaluations.end_evaluation(checkpoint)
            return
        log.info("started on %s (%d episodes of %s; log: %s)", os.path.basename(checkpoint),
                 self.cfg.episodes, self.cfg.task, self.running.log_path)

    def _reap(self, start_next: bool = True) -> None:
        """If the running evaluation ended: record a failure (not a scheduler's signal), release its marker, start
        the waiting one."""
        if self.running is None or not self.running.finished():
            return
        done, self.running = self.running, None
        done.wait()
        error = done.error()
        if error is not None:
            remove_partial(done.checkpoint)
        if error is not None and -done.proc.returncode in PREEMPTION_SIGNALS:
            # the scheduler's signal to every process of the job, which preempts the trainer too: not
            # the checkpoint's failure; its marker stays, and the resumed run evaluates it again
            log.warning("the evaluation of %s was ended by %s from outside the trainer; it counts as interrupted "
                        "and the resumed run evaluates it again", os.path.basename(done.checkpoint),
                        signal.Signals(-done.proc.returncode).name)
        else:
            if error is not None:
                self._failed(done.checkpoint, error)
            evaluations.end_evaluation(done.checkpoint)
        if self.waiting is not None and start_next:
            waiting, self.waiting = self.waiting, None
            self._start(waiting)

    def _failed(self, checkpoint: str, error: str) -> None:
        """Record the failure in the checkpoint (the next poll logs it); training goes on."""
        try:
            evaluations.record_failure(checkpoint, error)
        except OSError as e:  # the checkpoint is gone, or its disk is full: say it here instead
            log.warning("evaluation of %s failed: %s; and its failure could not be recorded (%s)",
                        os.path.basename(checkpoint), error, e)

    def _stop_running(self, why: str) -> None:
        """Stop the running evaluation; its marker and the waiting one's stay (redone on resume)."""
        if self.running is None:
            return
        stopped, self.running, self.waiting = self.running, None, None
        log.warning("stopping the evaluation of %s (%s); the resumed run evaluates it again",
                    os.path.basename(stopped.checkpoint), why)
        stopped.stop()
        remove_partial(stopped.checkpoint)
        if evaluations.read_report(stopped.checkpoint) is not None:  # it ended as it was stopped
            evaluations.end_evaluation(stopped.checkpoint)

    def _stop_at_exit(self) -> None:
        self._stop_heartbeat.set()
        self._stop_running("the trainer exits")

    def _keep_markers(self) -> None:
        """Touch the markers of the running and the waiting checkpoint while they wait or run."""
        while not self._stop_heartbeat.wait(evaluations.HEARTBEAT_S):
            running = self.running
            for checkpoint in (running.checkpoint if running else None, self.waiting):
                if checkpoint is not None:
                    with contextlib.suppress(FileNotFoundError):  # ended (and removed) meanwhile
                        evaluations.heartbeat(checkpoint)

    def _resume_interrupted(self) -> None:
        """Evaluations the previous process of this run left unfinished (their markers outlived it; with
        runner trainer no one else evaluates this run): the oldest starts now, the newest waits, any
        between are skipped."""
        interrupted = [c for c in complete_checkpoints(self.run_dir) if evaluations.read_report(c) is None
                       and os.path.exists(os.path.join(c, evaluations.EVALUATING))]
        if not interrupted:
            return
        log.info("evaluating again what the previous run left unfinished: %s",
                 ", ".join(os.path.basename(c) for c in interrupted))
        for skipped in interrupted[1:-1]:
            evaluations.end_evaluation(skipped)
        for checkpoint in interrupted[:1] + interrupted[1:][-1:]:
            evaluations.begin_evaluation(checkpoint, self.owner)
        self._start(interrupted[0])
        self.waiting = interrupted[-1] if len(interrupted) > 1 else None

    # ---- logging ------------------------------------------------------------------------------
    def _log_new_records(self) -> None:
        """Log each report and failure record in the run's checkpoints not logged yet, in step order."""
        new_report = False
        for step, checkpoint in saved_steps(self.run_dir):
            if (step, "report") not in self.logged and os.path.exists(evaluations.report_path(checkpoint)):
                self.logged.add((step, "report"))
                new_report |= self._log_report(step, checkpoint)
            elif (step, "error") not in self.logged and (step, "report") not in self.logged:
                error = evaluations.read_failure(checkpoint)
                if error is not None:
                    self.logged.add((step, "error"))
                    log.warning("evaluation of %s failed: %s. Training goes on; the checkpoint counts as "
                                "unevaluated", os.path.basename(checkpoint), error)
                    self.metrics.log_evaluation(step, {"eval/error": error})
        if new_report:
            try:
                evaluations.update_best(self.run_dir)
            except OSError as e:
                log.warning("`best` of %s could not be updated (%s); it is retried at the next save", self.run_dir, e)

    def _log_report(self, step: int, checkpoint: str) -> bool:
        report = evaluations.read_report(checkpoint)  # None: unreadable, warned there
        if report is None:
            return False
        try:
            figures = figures_of(report)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("%s lacks %s; not logged", evaluations.report_path(checkpoint), e)
            return False
        rows = report["results"]["policy"].get("per_episode", [])
        video = next((row["video"] for row in rows if "video" in row), None)
        folder = os.path.dirname(evaluations.report_path(checkpoint))
        self.metrics.log_evaluation(step, figures, os.path.join(folder, video) if video else None)
        log.info("evaluation of %s: success %.1f%% (95%% CI %.1f-%.1f%%) over %d episodes of %s",
                 os.path.basename(checkpoint), 100 * float(figures["eval/success_rate"]),
                 100 * float(figures["eval/success_low"]), 100 * float(figures["eval/success_high"]),
                 int(figures["eval/episodes"]), report.get("task", "?"))
        return True
