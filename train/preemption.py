"""Preemption: SIGTERM / SIGUSR1 ask the trainer to finish the step, save and exit.

The exit code REQUEUE_EXIT_CODE (75, EX_TEMPFAIL) tells a launcher that the run
stopped on purpose with a fresh checkpoint and should be requeued with
`resume.checkpoint_path=auto`.
"""
import signal
from types import FrameType

from utils.child import PREEMPTION_SIGNALS

REQUEUE_EXIT_CODE = 75


class PreemptionFlag:
    def __init__(self) -> None:
        self.signal: str | None = None
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal is not None
