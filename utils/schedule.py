"""Learning-rate schedules as multipliers of each param group's base lr.

The multiplier for optimizer step s (1-based: the first update is s = 1) is set
*before* that update, so the first update already runs at the warmup lr. Each
param group keeps its own base lr in `initial_lr` (Muon and AdamW groups differ).
"""
import math
from typing import Any, Callable

SCHEDULES = ("linear", "cosine", "constant")  # training.scheduler_type


def linear_multiplier(s: int, warmup_steps: int, cycle_length: int, f_start: float, f_max: float,
                      f_min: float) -> float:
    """Motus's linear warmup then linear decay to f_min at `cycle_length`."""
    if s <= 0:
        return f_start
    if s <= warmup_steps:
        return f_start + (f_max - f_start) * s / warmup_steps
    if s < cycle_length:
        return f_min + (f_max - f_min) * (cycle_length - s) / (cycle_length - warmup_steps)
    return f_min


def cosine_multiplier(s: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to `min_ratio` at `max_steps`."""
    if s <= 0:
        return 0.0
    if s <= warmup_steps:
        return s / warmup_steps
    progress = min(1.0, (s - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets `group["lr"] = group["initial_lr"] * multiplier(step)` on every param group.

    Its state is the number of updates already taken; a run restarts it on purpose
    (`resume.reset_scheduler`) by not loading it.
    """

    def __init__(self, training_cfg: Any) -> None:
        t = training_cfg
        self.kind = t.scheduler_type
        if self.kind == "linear":  # recipe/config.py checks warmup_steps < cycle_length
            self._fn: Callable[[int], float] = lambda s: linear_multiplier(
                s, t.warmup_steps, t.cycle_length, t.f_start, t.f_max, t.f_min)
        elif self.kind == "cosine":
            min_ratio = t.min_lr / t.learning_rate if t.learning_rate > 0 else 0.0
            self._fn = lambda s: cosine_multiplier(s, t.warmup_steps, t.max_steps, min_ratio)
        else:
            self._fn = lambda s: 1.0
        self.last_step = 0

    def apply(self, param_groups: list[dict[str, Any]]) -> list[float]:
        """Set the lr of the next update (step last_step + 1) in every group of `param_groups` (a torch
        optimizer's, each with its base lr in "initial_lr") and advance; returns the lrs set."""
        self.last_step += 1
        m = self._fn(self.last_step)
        for group in param_groups:
            group["lr"] = group["initial_lr"] * m
        return [group["lr"] for group in param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "last_step": self.last_step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue a saved schedule; one of another kind is refused, never silently continued at a
        step that means something else (a reset run does not load it: train/train.py)."""
        if sd["kind"] != self.kind:
            raise ValueError(f"the checkpoint's lr schedule is scheduler_type {sd['kind']}, this run's is "
                             f"{self.kind}; set resume.reset_scheduler=true to restart the schedule, or "
                             f"training.scheduler_type={sd['kind']} to continue it")
        self.last_step = int(sd["last_step"])
