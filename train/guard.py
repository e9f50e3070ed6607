"""What the loop does about non-finite steps and failed saves.

A step whose loss or gradient norm is not finite on any rank is skipped by the engine on every
rank (train/engine.py); `NonFiniteGuard` counts those steps, warns about each and stops the run
after `training.max_nonfinite_steps` in a row. A checkpoint is never written from non-finite
weights. Both stops, and a save that fails (a full disk), end the run with their own exit code
and one message on the main rank, instead of a traceback from every rank.
"""
import logging
import math
import sys
from collections.abc import Callable, Mapping
from typing import NoReturn

import torch

from checkpoint.checkpointer import CheckpointSaveError
from train.engine import Engine
from train.trainer_state import TrainerState
from utils import dist

log = logging.getLogger("train")

NONFINITE_EXIT_CODE = 76
"""The run diverged: too many non-finite steps in a row, or non-finite weights at a save."""
SAVE_FAILED_EXIT_CODE = 74
"""A checkpoint could not be written (EX_IOERR: a full disk, a write error); nothing was lost."""


class NonFiniteError(RuntimeError):
    """The run cannot continue from its current weights; nothing was saved."""


class NonFiniteGuard:
    """Counts skipped steps (in the trainer state's `skipped_nonfinite_steps`, logged to metrics.jsonl)
    and stops the run after `max_consecutive` in a row."""

    def __init__(self, state: TrainerState, max_consecutive: int, device: torch.device | str = "cpu") -> None:
        self.state = state
        self.device = device  # the one the process group serves (NCCL: the GPU)
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.error: NonFiniteError | None = None

    @property
    def last_step_finite(self) -> bool:
        return self.consecutive == 0

    def after_step(self, step: int, skipped: bool, loss_sum: Mapping[str, torch.Tensor],
                   grad_norm: float | torch.Tensor) -> None:
        """Call on every rank after each optimizer step (`skipped` is the same on every rank);
        `check()` raises, once the step is logged, when too many were skipped in a row."""
        if not skipped:
            self.consecutive = 0
            return
        self.state.skipped_nonfinite_steps += 1
        self.consecutive += 1
        # read back only on a skipped step (rare); averaged over ranks, so a rank's NaN shows
        losses = dist.mean_across_ranks({k: v.item() for k, v in loss_sum.items()}, self.device)
        terms = ", ".join(f"{k}={v:.4g}" for k, v in losses.items())
        if dist.is_main():
            log.warning("step %d: non-finite loss or gradient norm on some rank (%s, grad_norm=%s): the update "
                        "was skipped on every rank (%d in a row, %d in this run; the run stops at %d in a row)",
                        step, terms, _number(grad_norm), self.consecutive, self.state.skipped_nonfinite_steps,
                        self.max_consecutive)
        if self.consecutive >= self.max_consecutive:
            self.error = NonFiniteError(
                f"{self.consecutive} steps in a row (up to step {step}) had a non-finite loss or gradient norm "
                f"(last: {terms}, grad_norm={_number(grad_norm)}); the run stopped without saving. "
                "Resume from the last checkpoint with a lower training.learning_rate, gradient clipping "
                "(training.grad_clip_norm) or more warmup (training.warmup_steps); "
                "training.max_nonfinite_steps sets how many skipped steps in a row are tolerated")

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _number(value: float | torch.Tensor) -> str:
    value = float(value)
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def check_weights_before_save(engine: Engine, step: int, run_dir: str) -> None:
    """Collective. Raise NonFiniteError when some rank's weights are not finite: never save them."""
    if not engine.weights_finite():
        raise NonFiniteError(f"the weights are not finite at step {step}; no checkpoint was written "
                             f"(the complete checkpoints of {run_dir} are untouched). Resume from the last "
                             "one with a lower training.learning_rate or gradient clipping")


def health(guard: NonFiniteGuard) -> dict[str, bool]:
    """What a checkpoint saved now records (weights: check_weights_before_save passed)."""
    return {"weights_finite": True, "loss_finite": guard.last_step_finite}


def stop(message: str, code: int) -> NoReturn:
    """End the run: the message once, on the main rank; the same exit code on every rank."""
    if dist.is_main():
        print(f"error: {message}", file=sys.stderr, flush=True)
    dist.leave(code)


def run_guarded(main: Callable[[], None]) -> None:
    """Run the trainer's main(); a divergence or a failed save ends it with its exit code."""
    try:
        main()
    except NonFiniteError as e:
        stop(str(e), NONFINITE_EXIT_CODE)
    except CheckpointSaveError as e:
        stop(str(e), SAVE_FAILED_EXIT_CODE)
