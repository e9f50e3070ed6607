"""Closed-loop evaluations of a run's checkpoints, recorded in the checkpoints' own folders, and the
run's best checkpoint.

A checkpoint is evaluated by `python -m inference.rollout --checkpoint CKPT --out CKPT/eval` (the
trainer starts it beside training, or `python -m inference.follow` as a job of its own). What it
leaves in the sealed `checkpoint_step_N/` folder, none of it listed in the manifest (verification
and `auto` resume ignore it, checkpoint/checkpointer.py `not_listed`):
  eval/report.json   the rollout's report (results.policy.success_rate, successes, episodes, wilson_95...)
  EVALUATING         while an evaluation runs: its owner (host:pid); the owner touches it every
                     HEARTBEAT_S, and retention never deletes a checkpoint whose marker is live
  eval_failed.json   the error of the last evaluation that failed; the checkpoint counts as unevaluated
`{run_dir}/best` names the complete checkpoint with the highest policy success (ties: the later
step), as `latest` names the newest; it is rewritten whenever a report lands or retention runs.
"""
import contextlib
import glob
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from checkpoint import disk
from checkpoint.layout import complete_checkpoints, step_of

EVAL_DIR = "eval"
REPORT = "report.json"
EVALUATING = "EVALUATING"
FAILED = "eval_failed.json"
BEST = "best"
PARTIAL = f".{EVAL_DIR}.partial_"
"""inference.rollout writes its report into a temporary `.eval.partial_*` folder beside --out, then renames it."""
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
"""A marker untouched this long is left over from an evaluation that died (ten missed heartbeats: a
shared file system's clocks and caches may lag)."""
log = logging.getLogger("checkpoint")


def added_after_save(rel: str) -> bool:
    """Whether the file `rel` (relative to its checkpoint folder) is an evaluation's record, written into
    the folder after it was sealed."""
    top = rel.split(os.sep, 1)[0]
    return top in (EVAL_DIR, EVALUATING, FAILED) or top.startswith(PARTIAL)


def report_path(checkpoint: str) -> str:
    return os.path.join(checkpoint, EVAL_DIR, REPORT)


def read_report(checkpoint: str) -> dict[str, Any] | None:
    """The rollout report of `checkpoint`; None when it has none, or one that cannot be read (warned)."""
    path = report_path(checkpoint)
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s cannot be read (%s): the checkpoint counts as unevaluated", path, e)
        return None
    if not isinstance(report, dict) or policy_success(report) is None:
        log.warning("%s has no results.policy.success_rate (not an inference.rollout report): the checkpoint "
                    "counts as unevaluated", path)
        return None
    return report


def policy_success(report: Mapping[str, Any]) -> float | None:
    """results.policy.success_rate of a rollout report, or None when it has none."""
    results = report.get("results")
    policy = results.get("policy") if isinstance(results, dict) else None
    rate = policy.get("success_rate") if isinstance(policy, dict) else None
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def rollout_command(checkpoint: str, evaluation: Mapping[str, Any], python: str) -> list[str]:
    """The argv evaluating `checkpoint` into its eval/ folder. `evaluation`: task, episodes, seed, workers,
    videos, replan, episode_steps, device; None (or absent) leaves inference.rollout's default; the
    baselines are never run (they do not depend on the checkpoint)."""
    for key in ("task", "episodes"):
        if evaluation.get(key) is None:
            raise ValueError(f"the evaluation of {checkpoint} needs a {key!r}; got {dict(evaluation)}")
    cmd = [python, "-m", "inference.rollout", "--task", str(evaluation["task"]), "--checkpoint", checkpoint,
           "--episodes", str(evaluation["episodes"]), "--out", os.path.join(checkpoint, EVAL_DIR)]
    for key, flag in (("seed", "--seed"), ("workers", "--workers"), ("videos", "--videos"),
                      ("replan", "--replan"), ("episode_steps", "--steps"), ("device", "--device")):
        if evaluation.get(key) is not None:
            cmd += [flag, str(evaluation[key])]
    return cmd + ["--baselines", ""]


def default_owner() -> str:
    """This process, as a marker names its owner: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def begin_evaluation(checkpoint: str, owner: str) -> None:
    """Mark `checkpoint` as being evaluated by `owner` (host:pid); FileNotFoundError when it is gone."""
    disk.fsync_write(os.path.join(checkpoint, EVALUATING), json.dumps({"owner": owner, "started": time.time()}))


def heartbeat(checkpoint: str) -> None:
    """The owner's sign of life: the marker's time is now."""
    os.utime(os.path.join(checkpoint, EVALUATING))


def end_evaluation(checkpoint: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(checkpoint, EVALUATING))


def _owner_is_gone(owner: str) -> bool:
    """True when `owner` (host:pid) is a process of this host that no longer exists."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another host's process: only its heartbeat tells
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    return False


def is_being_evaluated(checkpoint: str, stale_after_s: float = STALE_AFTER_S) -> bool:
    """A live marker: touched within `stale_after_s`, by an owner not known to be dead."""
    path = os.path.join(checkpoint, EVALUATING)
    try:
        age = time.time() - os.path.getmtime(path)
        with open(path) as f:
            owner = str(json.load(f).get("owner", ""))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):  # half-written by its owner this instant: its age decides
        owner = ""
    return age < stale_after_s and not _owner_is_gone(owner)


def record_failure(checkpoint: str, error: str) -> None:
    """Record why an evaluation of `checkpoint` failed; its partial output is gone, so it counts as unevaluated."""
    disk.fsync_write(os.path.join(checkpoint, FAILED), json.dumps({"error": error, "time": time.time()}, indent=1))


def read_failure(checkpoint: str) -> str | None:
    """The error of the last failed evaluation of `checkpoint`, or None."""
    try:
        with open(os.path.join(checkpoint, FAILED)) as f:
            return str(json.load(f)["error"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        return f"{os.path.join(checkpoint, FAILED)} cannot be read ({e})"


def clear_failure(checkpoint: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(checkpoint, FAILED))


def discard_partial(checkpoint: str) -> list[str]:
    """Remove what an evaluation that was stopped or died left in `checkpoint`: the rollout's temporary
    `.eval.partial_*` folders, and an eval/ folder without a readable report (a new rollout needs it
    empty). Returns what was removed."""
    found = glob.glob(os.path.join(checkpoint, PARTIAL + "*"))
    if os.path.isdir(os.path.join(checkpoint, EVAL_DIR)) and read_report(checkpoint) is None:
        found.append(os.path.join(checkpoint, EVAL_DIR))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


def best_checkpoint(run_dir: str) -> str | None:
    """The complete checkpoint of `run_dir` with the highest policy success in its report (ties: the
    later step); None when none has a report."""
    scored = []
    for path in complete_checkpoints(run_dir):
        report = read_report(path)
        if report is not None:
            scored.append((policy_success(report), step_of(path), path))
    return max(scored)[2] if scored else None


def update_best(run_dir: str) -> None:
    """Point `{run_dir}/best` at best_checkpoint (written atomically, like `latest`); remove it when
    there is none. Safe to call from the trainer and a follower at once."""
    best = best_checkpoint(run_dir)
    target = os.path.join(run_dir, BEST)
    if best is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(target)
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{BEST}.", dir=run_dir)  # one per writer: two never share it
    os.close(fd)
    try:
        disk.fsync_write(tmp, os.path.basename(best) + "\n")
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def read_best(run_dir: str) -> str | None:
    """The checkpoint folder `{run_dir}/best` names, or None when the run has no `best`."""
    try:
        with open(os.path.join(run_dir, BEST)) as f:
            return os.path.join(run_dir, f.read().strip())
    except FileNotFoundError:
        return None
