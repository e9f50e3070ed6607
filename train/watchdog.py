"""A rank that stops making progress exits instead of hanging.

A collective whose peer never arrives ends after `system.dist_timeout_minutes`, but a rank can hang
where no collective waits: a data worker that never answers (a fork that deadlocked inside CPython,
a stalled network file system), a kernel that never returns. Then its peers wait in the next
collective and the job holds its nodes doing nothing; a SIGTERM does not help either, because the
preemption handler saves at the next step boundary, which never comes.

The trainer re-arms this watchdog once per iteration of its loop: a step with its validation,
logging and save. If `system.hang_timeout_minutes` pass without one, Python's faulthandler writes
every thread's stack under a `Timeout (H:MM:SS)!` line (where the rank hangs) to the rank's own file,
`{run_dir}/hang_stacks_rank_R.txt`, and ends the process with exit code 1: the launcher stops the
other ranks, and the run resumes from its last save. faulthandler waits in a C thread of its own, so
it fires even when the hung thread holds the GIL. A file per rank because the ranks of a hung run
time out together: on one shared stderr their dumps interleave mid-line and neither can be read.
The file is appended to (an earlier launch's stacks stay) and removed when this launch leaves it empty.
"""
import faulthandler
import logging
import os
from types import TracebackType
from typing import TextIO

log = logging.getLogger(__name__)


def stacks_path(run_dir: str, rank: int | str) -> str:
    return os.path.join(run_dir, f"hang_stacks_rank_{rank}.txt")


class Watchdog:
    def __init__(self, minutes: float | None, run_dir: str, rank: int) -> None:
        self.seconds = None if minutes is None else float(minutes) * 60
        self.run_dir = run_dir
        self.path = stacks_path(run_dir, rank)
        self.file: TextIO | None = None

    def progress(self) -> None:
        """An iteration ended: the next one has the whole timeout (re-arming cancels the pending one)."""
        if self.file is not None and self.seconds is not None:
            faulthandler.dump_traceback_later(self.seconds, exit=True, file=self.file)

    def __enter__(self) -> "Watchdog":
        if self.seconds is not None:
            if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
                log.warning("an earlier launch of this run hung: its stacks are in %s", self.path)
            self.file = open(self.path, "a")
            log.info("a rank without progress for %g min writes its stacks to %s and exits with code 1",
                     self.seconds / 60, stacks_path(self.run_dir, "R"))
        self.progress()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Out of the loop: waiting for the last evaluation is not a training step."""
        if self.file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self.file.close()
        if os.path.getsize(self.path) == 0:
            os.remove(self.path)
