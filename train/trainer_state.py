"""The trainer's own counters, a checkpoint part (`trainer_state.json`)."""
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainerState:
    step: int = 0
    """Optimizer updates taken."""
    samples_seen: int = 0
    skipped_nonfinite_steps: int = 0
    """Steps whose update was skipped: a non-finite loss or gradient norm on some rank (train/guard.py)."""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.samples_seen = int(sd["step"]), int(sd["samples_seen"])
        self.skipped_nonfinite_steps = int(sd["skipped_nonfinite_steps"])
