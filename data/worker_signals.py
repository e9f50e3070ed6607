"""DataLoader workers that live through the preemption signal sent to every process of a job.

A scheduler that preempts a job (SLURM's scancel and time limit without `--signal=B:`, a plain
`pkill`) signals every process, DataLoader workers included. torch's worker handles SIGTERM in C:
from its parent it exits quietly, from anyone else it dies, and SIGUSR1's default action kills it.
Either way the rank's next batch raises "DataLoader worker exited unexpectedly" before the rank has
acted on the same signal and saved its preemption checkpoint (train/preemption.py).

Here a worker keeps torch's rule for the parent and ignores the rest. Workers are started with
SIGTERM and SIGUSR1 blocked (`workers_started_blocked`: a forked child inherits the mask, and so does
every thread it starts, native ones included), and `worker_init_fn` takes SIGTERM on a thread with
`sigwaitinfo`, which tells who sent it (a Python signal handler cannot). The parent's own SIGTERM
(multiprocessing's terminate at shutdown) still ends the worker; a worker whose parent died exits on
torch's watchdog as before; SIGUSR1 is ignored.
"""
import contextlib
import logging
import os
import signal
import threading
from typing import Iterator

from utils.child import PREEMPTION_SIGNALS

logger = logging.getLogger(__name__)


_SUPPORTED = hasattr(signal, "sigwaitinfo")  # Linux; elsewhere (macOS) torch's own handling stays


def worker_init_fn(worker_id: int) -> None:
    """Run in each DataLoader worker before it loads anything (the DataLoader's `worker_init_fn`)."""
    if not _SUPPORTED:
        return
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)  # already, where workers_started_blocked forked it
    threading.Thread(target=_take_sigterm, args=(os.getppid(),), name=f"sigterm-{worker_id}", daemon=True).start()


def _take_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            os._exit(0)  # torch's rule: the parent ends its worker quietly
        logger.debug("DataLoader worker %d ignored SIGTERM from pid %d: the rank saves and stops it",
                     os.getpid(), info.si_pid)


@contextlib.contextmanager
def workers_started_blocked() -> Iterator[None]:
    """Around `iter(loader)`: its workers are born with PREEMPTION_SIGNALS blocked. The rank's own
    copy of a signal arriving meanwhile waits, and its handler runs when the block is lifted."""
    if not _SUPPORTED:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
