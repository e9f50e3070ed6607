"""One metrics.jsonl record of a logged step."""
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from train.trainer_state import TrainerState
from utils import dist


def make_record(*, step: int, loss_sum: Mapping[str, float | torch.Tensor], grad_norm: float | torch.Tensor,
                param_groups: Sequence[dict[str, Any]], lrs: Sequence[float], val: dict[str, float] | None,
                state: TrainerState, samples_per_sec: float, step_time: float, skipped: int) -> dict[str, Any]:
    """One metrics.jsonl record; the losses (device tensors) are averaged over ranks and read back here."""
    record = {"step": step, **dist.mean_across_ranks(loss_sum),
              "grad_norm": float(grad_norm),
              "lr": {g.get("name", str(i)): lr for i, (g, lr) in enumerate(zip(param_groups, lrs))},
              "samples_per_sec": samples_per_sec, "step_time": step_time, "samples_seen": state.samples_seen,
              "skipped_samples": skipped, "skipped_nonfinite_steps": state.skipped_nonfinite_steps,
              "cpu_seconds": state.cpu_seconds}
    if state.cpu_seconds_since_step:  # resumed from a checkpoint saved before the clock: counted from there
        record["cpu_seconds_since_step"] = state.cpu_seconds_since_step
    record.update({f"val_{k}": v for k, v in (val or {}).items()})
    return record
