"""Child processes that run in a session of their own and still never outlive their parent.

The trainer's rollouts, the follower's rollouts and a rollout's policy server each run in a session of
their own, so that a Ctrl-C or a scheduler's signal meant for the parent does not reach them: the parent
stops them itself, in order (the rollout stops its server, then its workers). That leaves the case the
parent cannot handle: its own death by SIGKILL (the OOM killer, `kill -9`, a launcher's last resort),
where no handler and no `atexit` runs. On Linux the child asks the kernel for a signal when its parent
dies (prctl PR_SET_PDEATHSIG); otherwise a killed trainer's rollout would go on for minutes and race
the resumed run's rollout of the same checkpoint.

The kernel sends the signal when the *thread* that started the child ends: start children from the
main thread (every caller here does).

The child also gets `on_parent_death` back at its default action, since that is the signal it is
stopped with: a shell starts a background job (`nohup ... &`, a CI runner's script) with SIGINT
ignored, every descendant inherits that across exec, and a rollout that ignores SIGINT can only be
killed after a grace period, its server and workers left to the same fate.
"""
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# What a scheduler stops a job with (Slurm's preemption and time limit, scancel, pkill), often sent to
# every process of the job: the trainer saves on them (train/preemption.py), and its children must not
# turn them into a failure first (data/worker_signals.py, train/evaluation.py).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _load_prctl() -> "Callable[..., int] | None":
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl


_PRCTL = _load_prctl()  # resolved here: the child, between fork and exec, only calls it


def bound_to_parent(cmd: Sequence[str], on_parent_death: signal.Signals, **popen: Any) -> "subprocess.Popen[Any]":
    """`subprocess.Popen(cmd, **popen)` in a new session, with `on_parent_death` not ignored; on Linux the
    child receives it when this process dies, however it dies (choose the signal the child stops cleanly
    on, the one its parent stops it with)."""
    parent = os.getpid()

    def bind() -> None:  # runs in the child, before exec; both settings survive exec
        signal.signal(on_parent_death, signal.SIG_DFL)
        if _PRCTL is not None:
            _PRCTL(PR_SET_PDEATHSIG, int(on_parent_death))
        if os.getppid() != parent:  # the parent died before the call: no signal will come
            os._exit(128 + int(on_parent_death))

    return subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=bind, **popen)
