"""The interface over the two ways a step runs: a DeepSpeed engine (ZeRO-0/1/2, train/deepspeed_engine.py)
or DDP (train/ddp_engine.py); train/launch.py builds the one a launch asks for.

Both own the micro-step / optimizer-step split, so that gradient accumulation, clipping, the lr schedule,
the skip of a non-finite step and the EMA update behave the same in both. Both are the checkpoint part
in the folder `ENGINE_DIR` (checkpoint/files.py): model and optimizer state, the ZeRO layout and the EMA.
The EMA of whole parameters (DDP, DeepSpeed stage 0) is saved here; ZeRO's partitioned one by
train/deepspeed_engine.py.
"""
import contextlib
import logging
import os
from abc import ABC, abstractmethod
from typing import Any, Iterator, Mapping, Optional

import torch

from checkpoint.files import EMA_FILE
from checkpoint.zero import CheckpointConvertError
from optim.hyperparameters import apply_group_options, group_options
from train.ema import EMA
from utils import dist
from utils.batch import FlowLosses, ModelBatch

log = logging.getLogger(__name__)


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
        return EMA(settings, [p for _, p in self._trainable()])

    def _trainable(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.unwrapped_model().named_parameters() if p.requires_grad]

    @abstractmethod
    def micro_step(self, inputs: ModelBatch, is_last: bool) -> FlowLosses:
        """Forward and backward of one micro batch; gradients sync only at the last micro-step. Returns the
        model's losses (their `logged()` part is what the trainer averages over micro-steps)."""

    def optimizer_step(self, step: int) -> tuple[Any, bool]:
        """Finish update `step` (1-based) after its last micro-step, then update the EMA. Returns (the
        pre-clip gradient norm, skipped): the norm is a tensor or a number, read back to the host only
        when it is logged; `skipped` (a bool, the same on every rank) says the update was not applied
        because the loss or the gradient norm was not finite on some rank."""
        norm, skipped = self._apply_update()
        if self.ema is not None and not skipped:  # a skipped step changed no weight
            self.ema.update(step)
        return norm, skipped

    @abstractmethod
    def _apply_update(self) -> tuple[Any, bool]:
        """The update itself: clip, check, step (or skip); returns optimizer_step's pair."""

    @abstractmethod
    def master_bytes(self) -> int:
        """Bytes of fp32 master weights this rank keeps beside the module's (0: the module's are the masters)."""

    @torch.no_grad()
    def weights_finite(self) -> bool:
        """Collective: True on every rank when every rank's parameters are all finite (read at a save)."""
        flags = [torch.isfinite(p).all() for p in self.unwrapped_model().parameters()]
        return not dist.any_rank(~torch.stack(flags).all() if flags else False)

    def optimizer_state_report(self) -> str:
        """One line: the optimizer-state bytes this rank holds (fp32 masters under ZeRO, the optimizer's
        own state, the EMA). Read after the first step, when the optimizer has created its state."""
        own = sum(t.numel() * t.element_size() for s in self.base_optimizer.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.dim() > 0)
        masters = self.master_bytes()
        ema = self.ema.nbytes if self.ema is not None else 0
        mib = 2 ** 20
        return (f"optimizer state on rank {dist.rank()} of {dist.world_size()}: {(own + masters + ema) / mib:.2f} "
                f"MiB (fp32 master partitions {masters / mib:.2f}, optimizer state {own / mib:.2f}, "
                f"EMA {ema / mib:.2f})")

    @contextlib.contextmanager
    def ema_swapped_in(self) -> Iterator[None]:
        """Collective (under ZeRO): the model computes with the EMA weights inside the block."""
        assert self.ema is not None, "ema_swapped_in needs training.ema.enabled"
        with self.ema.swapped_in(self._refresh_module_weights):
            yield

    def _refresh_module_weights(self) -> None:
        """After the masters changed outside a step: nothing to do where the masters are the weights."""

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    # --- the checkpoint part (the folder ENGINE_DIR) -----------------------------------------------
    def save(self, folder: str) -> None:
        """Collective: every rank writes its part of the model and optimizer state into `folder`, with
        the layout that lets a checkpoint move to another world size (checkpoint/zero.py), and the EMA."""
        self._save_state(folder)
        if self.ema is not None:  # after DeepSpeed's collectives: a failed write here cannot split them
            self._save_ema(folder)

    def load(self, folder: str, saved_world_size: int) -> None:
        """Collective. At another world size the state is re-partitioned by parameter name. The param
        groups keep this run's hyperparameters (the YAML's): only the state comes from the checkpoint."""
        built = group_options(self.base_optimizer)
        if self.ema is not None:
            self._load_ema(folder, saved_world_size)
        self._load_state(folder, saved_world_size)
        apply_group_options(self.base_optimizer, built)

    @abstractmethod
    def _save_state(self, folder: str) -> None: ...

    @abstractmethod
    def _load_state(self, folder: str, saved_world_size: int) -> None: ...


    def _save_ema(self, folder: str) -> None:
        assert self.ema is not None
        save_named_ema(self.ema, [n for n, _ in self._trainable()], folder)

    def _load_ema(self, folder: str, saved_world_size: int) -> None:
        assert self.ema is not None
        if not load_named_ema(self.ema, [n for n, _ in self._trainable()], folder):
            self._ema_restarts(folder)

    def _ema_restarts(self, folder: str) -> None:
        assert self.ema is not None
        log.warning("%s holds no EMA (saved without training.ema.enabled): the EMA starts again, "
                    "from a copy of the weights at its next update", folder)
        self.ema.updates = 0


def save_named_ema(ema: EMA, names: list[str], folder: str) -> None:
    """The EMA of whole parameters, by name, in `folder`/ema.pt: rank 0 writes it (every rank holds the same)."""
    if dist.is_main():
        os.makedirs(folder, exist_ok=True)
        torch.save({"updates": ema.updates, "weights": dict(zip(names, ema.shadow))}, os.path.join(folder, EMA_FILE))


def load_named_ema(ema: EMA, names: list[str], folder: str) -> bool:
    """Restore the EMA of whole parameters by name (MuonAdamW's parameter order may differ between
    runs); False when `folder` holds none."""
    path = os.path.join(folder, EMA_FILE)
    if not os.path.isfile(path):
        return False
    saved = torch.load(path, map_location="cpu", weights_only=True)
    ema.restore(saved["updates"], [_named(saved["weights"], n, path) for n in names], folder)
    return True


def _named(weights: Mapping[str, torch.Tensor], name: str, path: str) -> torch.Tensor:
    if name not in weights:
        raise CheckpointConvertError(f"{path} has no EMA of '{name}'; resume needs the same model")
    return weights[name]
