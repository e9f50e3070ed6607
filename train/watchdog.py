"""A rank that stops making progress exits instead of hanging.

A collective whose peer never arrives ends after `system.dist_timeout_minutes`, but a rank can hang
where no collective waits: a data worker that never answers (a fork that deadlocked inside CPython,
a stalled network file system), a kernel that never returns. Then its peers wait in the next
collective and the job holds its nodes doing nothing; a SIGTERM does not help either, because the
preemption handler saves at the next step boundary, which never comes.

The trainer re-arms this watchdog once per iteration of its loop: a step with its validation,
logging and save. If `system.hang_timeout_minutes` pass without one, Python's faulthandler prints every thread's stack
to stderr under a `Timeout (H:MM:SS)!` line (where the rank hangs), and ends the process with exit
code 1: the launcher stops the other ranks, and the run resumes from its last save. faulthandler
waits in a C thread of its own, so it fires even when the hung thread holds the GIL.
"""
import faulthandler
import sys
from types import TracebackType


class Watchdog:
    def __init__(self, minutes: float | None) -> None:
        self.seconds = None if minutes is None else float(minutes) * 60

    def progress(self) -> None:
        """An iteration ended: the next one has the whole timeout (re-arming cancels the pending one)."""
        if self.seconds is not None:
            faulthandler.dump_traceback_later(self.seconds, exit=True, file=sys.stderr)

    def __enter__(self) -> "Watchdog":
        self.progress()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Out of the loop: waiting for the last evaluation is not a training step."""
        if self.seconds is not None:
            faulthandler.cancel_dump_traceback_later()
