"""Evaluate a run's checkpoints as they appear, as a job of its own (another node or GPU than training's).

    python -m inference.follow RUN_DIR [--poll-seconds S] [--once] [--task T] [--episodes N] [--seed S] \
        [--workers W] [--videos V] [--replan R] [--episode-steps E] [--device D] [--interval N]

The evaluation is the run's config.yaml `evaluation` section (each flag replaces its key, so a run
without one can be followed too). Every complete checkpoint due for evaluation (its step a multiple of
evaluation.interval, or the run's last step; every checkpoint without an interval) that has no report
is evaluated, oldest first, one at a time: those saved while the follower was down included. Each is
marked as being evaluated (retention never deletes it meanwhile), rolled out by `python -m
inference.rollout` into its eval/ folder as a child process, and the run's `best` is updated: the
records checkpoint/evaluations.py describes, the same the trainer writes and reads. A checkpoint
deleted or incomplete is skipped; a failed rollout is recorded (eval_failed.json) and the follower
goes on; one evaluated by someone else (a live marker) is left to them. It exits once the run has
saved its training.max_steps checkpoint and everything due is evaluated, or with --once after one
pass. Ctrl-C or SIGTERM stops the rollout and removes its partial output and the marker.
"""
import argparse
import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

from omegaconf import DictConfig, OmegaConf

from checkpoint import evaluations
from checkpoint.files import CONFIG_YAML
from checkpoint.layout import complete_checkpoints, is_complete, step_of
from data.sim_env import TASKS
from utils.child import bound_to_parent

log = logging.getLogger("follow")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_GRACE_S = 60
"""How long a stopped rollout has to stop its server and workers and remove its temporary folder."""
SETTINGS = {"task": str, "episodes": int, "seed": int, "workers": int, "videos": int, "replan": int,
            "episode_steps": int, "device": str, "interval": int}
"""The evaluation section's keys the follower reads, each with a flag of the same name (--episode-steps)."""


class FollowError(RuntimeError):
    """A run that cannot be followed as asked: the message names the file or flag and what was expected."""


class Stopped(Exception):
    """SIGTERM (a job's end): handled as Ctrl-C is."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="the run folder the trainer writes (its config.yaml and checkpoint_step_N folders)")
    p.add_argument("--poll-seconds", type=float, default=60.0, help="how often to look for new checkpoints")
    p.add_argument("--once", action="store_true", help="one pass over the checkpoints there now, then exit")
    for key, kind in SETTINGS.items():
        p.add_argument("--" + key.replace("_", "-"), type=kind, default=None,
                       help=f"replaces evaluation.{key} of the run's config.yaml")
    return p.parse_args(argv)


def read_config(run_dir: str) -> DictConfig | None:
    """The run's config.yaml (the trainer writes it at its start), or None before it exists."""
    path = os.path.join(run_dir, CONFIG_YAML)
    if not os.path.isfile(path):
        return None
    cfg = OmegaConf.load(path)
    if not isinstance(cfg, DictConfig):
        raise FollowError(f"{path}: expected a recipe (a mapping of sections), got a {type(cfg).__name__}")
    return cfg


def settings(cfg: DictConfig, args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    """The evaluation: config.yaml's `evaluation` section, each flag given replacing its key."""
    section = cfg.get("evaluation")
    found = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else {}
    assert isinstance(found, dict)  # a DictConfig's container is a dict
    ev: dict[str, Any] = {key: found.get(key) for key in SETTINGS}
    ev.update({key: getattr(args, key) for key in SETTINGS if getattr(args, key) is not None})
    for key in ("task", "episodes"):
        if ev[key] is None:
            raise FollowError(f"{os.path.join(run_dir, CONFIG_YAML)} sets no evaluation.{key}: pass "
                              f"--{key.replace('_', '-')}")
    if ev["task"] not in TASKS:
        raise FollowError(f"evaluation.task / --task {ev['task']!r}: expected one of {', '.join(sorted(TASKS))}")
    for key, least in (("episodes", 1), ("workers", 1), ("videos", 0), ("replan", 1), ("episode_steps", 1),
                       ("interval", 0)):
        if ev[key] is not None and ev[key] < least:
            raise FollowError(f"evaluation.{key} / --{key.replace('_', '-')} must be at least {least}, got {ev[key]}")
    return ev


def max_steps(cfg: DictConfig, run_dir: str) -> int:
    steps = OmegaConf.select(cfg, "training.max_steps")
    if not isinstance(steps, int):
        raise FollowError(f"{os.path.join(run_dir, CONFIG_YAML)}: training.max_steps is {steps!r}; expected the "
                          "step the run ends at (an integer)")
    return steps


def is_due(checkpoint: str, ev: dict[str, Any], last_step: int) -> bool:
    step = step_of(checkpoint)
    return step is not None and (not ev["interval"] or step % ev["interval"] == 0 or step == last_step)


def pending(run_dir: str, ev: dict[str, Any], last_step: int, failed: set[str]) -> list[str]:
    """Complete checkpoints due for evaluation without a report, oldest first; those that failed in this
    process and those someone else is evaluating left out."""
    return [p for p in complete_checkpoints(run_dir) if is_due(p, ev, last_step) and p not in failed
            and evaluations.read_report(p) is None and not evaluations.is_being_evaluated(p)]


class Rollout:
    """inference.rollout on one checkpoint, as a child in its own process group, its output passed on
    (and its last lines kept for the failure record)."""

    def __init__(self, checkpoint: str, ev: dict[str, Any]) -> None:
        self.cmd = evaluations.rollout_command(checkpoint, ev, sys.executable)
        self.proc = bound_to_parent(self.cmd, signal.SIGINT, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.tail: collections.deque[str] = collections.deque(maxlen=15)
        self.reader = threading.Thread(target=self._copy, daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None  # started with stdout=PIPE
        for line in self.proc.stdout:
            sys.stdout.write(f"  rollout | {line}")
            sys.stdout.flush()
            self.tail.append(line.rstrip())

    def wait(self, checkpoint: str) -> int:
        """Its exit code; the marker of `checkpoint` touched every heartbeat meanwhile."""
        while True:
            try:
                code = self.proc.wait(evaluations.HEARTBEAT_S)
                self.reader.join(10)
                return code
            except subprocess.TimeoutExpired:
                try:
                    evaluations.heartbeat(checkpoint)
                except FileNotFoundError:
                    log.warning("the marker of %s is gone: retention no longer knows it is being evaluated",
                                checkpoint)

    def stop(self) -> None:
        """Ctrl-C to its group (the rollout stops its server and workers and removes its temporary folder),
        then, after STOP_GRACE_S, SIGKILL."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def evaluate(checkpoint: str, ev: dict[str, Any], run_dir: str) -> bool | None:
    """Evaluate one checkpoint -> True (a report), False (failed, recorded) or None (deleted meanwhile:
    skipped)."""
    try:
        evaluations.begin_evaluation(checkpoint, evaluations.default_owner())
    except FileNotFoundError:
        log.info("%s was deleted before its evaluation began: skipped", checkpoint)
        return None
    rollout = None
    try:
        if not is_complete(checkpoint):  # retention renamed it away just before the marker
            log.info("%s is no longer complete: skipped", checkpoint)
            return None
        for path in evaluations.discard_partial(checkpoint):
            log.info("removed %s, left by an evaluation that did not finish", path)
        rollout = Rollout(checkpoint, ev)
        log.info("evaluating %s: %s", checkpoint, " ".join(rollout.cmd))
        code = rollout.wait(checkpoint)
        report = evaluations.read_report(checkpoint)
        if code == 0 and report is not None:
            evaluations.clear_failure(checkpoint)
            log.info("%s: policy success %.3f", checkpoint, evaluations.policy_success(report))
            return True
        if not is_complete(checkpoint):
            log.info("%s was deleted while it was evaluated: skipped", checkpoint)
            return None
        error = f"inference.rollout exited with code {code}: " + "\n".join(rollout.tail)
        log.error("the evaluation of %s failed (%s); going on", checkpoint, error)
        evaluations.record_failure(checkpoint, error)
        return False
    except BaseException:  # Ctrl-C, SIGTERM or a bug: the child goes with us, and leaves nothing half-written
        if rollout is not None:
            rollout.stop()
        evaluations.discard_partial(checkpoint)
        raise
    finally:
        evaluations.end_evaluation(checkpoint)
        try:
            evaluations.update_best(run_dir)
        except OSError as e:
            log.warning("`best` of %s could not be updated (%s); the next evaluation retries", run_dir, e)


def follow(args: argparse.Namespace) -> int:
    """The passes over the run folder; the exit code (1 when an evaluation failed)."""
    run_dir, waiting, warned = args.run_dir, False, False
    if not args.poll_seconds > 0:
        raise FollowError(f"--poll-seconds must be positive, got {args.poll_seconds}")
    failed: set[str] = set()
    while True:
        cfg = read_config(args.run_dir)
        if cfg is None:
            if args.once:
                raise FollowError(f"{os.path.join(run_dir, CONFIG_YAML)} does not exist: is '{run_dir}' a run folder "
                                  "(the trainer writes it there when it starts)?")
            if not waiting:
                log.info("waiting for %s (the trainer writes it when it starts)", os.path.join(run_dir, CONFIG_YAML))
                waiting = True
            time.sleep(args.poll_seconds)
            continue
        ev, last_step = settings(cfg, args, run_dir), max_steps(cfg, run_dir)
        if OmegaConf.select(cfg, "evaluation.task") and OmegaConf.select(cfg, "evaluation.runner") == "trainer" \
                and not warned:
            log.warning("%s sets evaluation.runner trainer: the trainer evaluates its checkpoints itself; this "
                        "follower takes those it has not begun (a live marker keeps the two apart)",
                        os.path.join(run_dir, CONFIG_YAML))
            warned = True
        todo = pending(run_dir, ev, last_step, failed)
        for checkpoint in todo:
            if checkpoint in pending(run_dir, ev, last_step, failed):  # still: retention or another evaluator
                if evaluate(checkpoint, ev, run_dir) is False:
                    failed.add(checkpoint)
        finished = any(step_of(p) == last_step for p in complete_checkpoints(run_dir))
        if args.once or (finished and not pending(run_dir, ev, last_step, failed)):
            break
        if not todo:
            time.sleep(args.poll_seconds)
    done = [p for p in complete_checkpoints(run_dir) if evaluations.read_report(p) is not None]
    log.info("%d checkpoints of %s have a report; best: %s; %d failed here%s", len(done), run_dir,
             evaluations.read_best(run_dir), len(failed), f" ({', '.join(sorted(failed))})" if failed else "")
    return 1 if failed else 0


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stopped(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _stop)
    try:
        sys.exit(follow(args))
    except FollowError as e:
        sys.exit(f"follow failed: {e}")
    except (KeyboardInterrupt, Stopped):
        sys.exit("follow stopped: the running evaluation (if any) is stopped and its partial output and marker "
                 "removed; run the same command again to go on")


if __name__ == "__main__":
    main()
