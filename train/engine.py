"""The interface over the two ways a step runs: a DeepSpeed engine (ZeRO-0/1/2, train/deepspeed_engine.py)
or DDP (train/ddp_engine.py); train/launch.py builds the one a launch asks for.

Both own the micro-step / optimizer-step split, so that gradient accumulation, clipping, the lr schedule
and the skip of a non-finite step behave the same in both. Both are the checkpoint part "engine"
(checkpoint/state.py): model and optimizer state, the ZeRO layout and the EMA, in one folder.
"""
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch

from optim.hyperparameters import apply_group_options, group_options
from train.ema import EMA
from utils import dist
from utils.batch import FlowLosses, ModelBatch


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """The loss to back-propagate: itself when finite (times exactly 1.0), else with every gradient
    made NaN. A non-finite loss on one rank then makes the globally reduced gradients, and so the
    global gradient norm, non-finite on every rank: the one norm check that skips the update
    (DeepSpeed's, or ours under DDP) covers a bad loss too, with no extra collective or host sync."""
    scale = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
    return loss * scale


class Engine(ABC):
    """Runs micro-steps and optimizer steps; saves and loads model + optimizer state and the EMA.

    A step whose loss or gradient norm is not finite on any rank updates nothing on any rank:
    `optimizer_step` then reports it as skipped (see `poison_nonfinite`).
    """
    model: Any
    """The model as the step runs it (DDP's wrapper, or DeepSpeed's engine): call it for a forward."""
    base_optimizer: torch.optim.Optimizer
    """The optimizer the recipe built (MuonAdamW, AdamW): its param groups take the lr schedule."""
    ema: Optional[EMA]
    """The EMA of the trainable weights (train/ema.py), None unless training.ema.enabled."""

    def __init__(self, accelerator: Any, cfg: Any) -> None:
        self.accelerator = accelerator
        self.grad_accum = cfg.training.gradient_accumulation_steps
        self.clip = cfg.training.grad_clip_norm

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups whose lr the schedule sets (those the update reads)."""
        return self.base_optimizer.param_groups

    def unwrapped_model(self) -> torch.nn.Module:
        return self.model.module if hasattr(self.model, "module") else self.model

    def whole_parameter_ema(self, settings: Any) -> Optional[EMA]:
        """An EMA over the whole trainable parameters (the optimizer updates them in place), or None."""
        if not settings.enabled:
            return None
        named = [(n, p) for n, p in self.unwrapped_model().named_parameters() if p.requires_grad]
        return EMA(settings, [p for _, p in named], names=[n for n, _ in named])

    @abstractmethod
    def micro_step(self, inputs: ModelBatch, is_last: bool) -> FlowLosses:
        """Forward and backward of one micro batch; gradients sync only at the last micro-step. Returns the
        model's losses (their `logged()` part is what the trainer averages over micro-steps)."""

    @abstractmethod
    def optimizer_step(self) -> tuple[Any, bool]:
        """Finish the update after the last micro-step. Returns (the pre-clip gradient norm, skipped):
        the norm is a tensor or a number, read back to the host only when it is logged; `skipped`
        (a bool, the same on every rank) says the update was not applied because the loss or the
        gradient norm was not finite on some rank."""

    @abstractmethod
    def master_bytes(self) -> int:
        """Bytes of fp32 master weights this rank keeps beside the module's (0: the module's are the masters)."""

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Collective: True on every rank when every rank's parameters are all finite (read at a save)."""
        flags = [torch.isfinite(p).all() for p in self.unwrapped_model().parameters()]
        return not dist.any_rank(~torch.stack(flags).all() if flags else False)

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    # --- the checkpoint part "engine" ----------------------------------------------------------
    def save(self, folder: str) -> None:
        """Collective: every rank writes its part of the model and optimizer state into `folder`, with
        the layout that lets a checkpoint move to another world size (checkpoint/zero.py), and the EMA."""
        self._save_state(folder)
        if self.ema is not None:  # after DeepSpeed's collectives: a failed write here cannot split them
            self.ema.save(folder)

    def load(self, folder: str, saved_world_size: int) -> None:
        """Collective. At another world size the state is re-partitioned by parameter name. The param
        groups keep this run's hyperparameters (the YAML's): only the state comes from the checkpoint."""
        built = group_options(self.base_optimizer)
        if self.ema is not None:
            self.ema.load(folder, saved_world_size)
        self._load_state(folder, saved_world_size)
        apply_group_options(self.base_optimizer, built)

    @abstractmethod
    def _save_state(self, folder: str) -> None: ...

    @abstractmethod
    def _load_state(self, folder: str, saved_world_size: int) -> None: ...

