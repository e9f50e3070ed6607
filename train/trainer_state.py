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
    cpu_seconds: float = 0.0
    """Training's CPU seconds over every rank since step `cpu_seconds_since_step` (train/cpu_clock.py)."""
    cpu_seconds_since_step: int = 0
    """0, unless the run was resumed from a checkpoint saved before the clock existed: its step."""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.samples_seen = int(sd["step"]), int(sd["samples_seen"])
        self.skipped_nonfinite_steps = int(sd["skipped_nonfinite_steps"])
        # a checkpoint from before the clock: it counts from here, and says so
        self.cpu_seconds = float(sd.get("cpu_seconds", 0.0))
        self.cpu_seconds_since_step = int(sd.get("cpu_seconds_since_step", self.step))
