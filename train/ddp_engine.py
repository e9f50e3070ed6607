"""The engine without DeepSpeed: accelerate wraps the model in DDP; the optimizer steps whole tensors."""
import contextlib
import os
from typing import Any

import torch

from checkpoint.files import DDP_MODEL_FILE, DDP_OPTIMIZER_FILE
from checkpoint.zero import optimizer_state_by_name, save_plain_layout
from train.engine import Engine, poison_nonfinite
from utils import dist
from utils.batch import FlowLosses, ModelBatch


class DDPEngine(Engine):
    """DDP: gradients all-reduced at the last micro-step, clipped and checked here, the step taken here."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Any) -> None:
        super().__init__(accelerator, cfg)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.base_optimizer = optimizer
        self.ema = self.whole_parameter_ema(cfg.training.ema)

    def micro_step(self, inputs: ModelBatch, is_last: bool) -> FlowLosses:
        sync = contextlib.nullcontext() if is_last else self.accelerator.no_sync(self.model)
        with sync:
            out = self.model(inputs)
            self.accelerator.backward(poison_nonfinite(out.loss) / self.grad_accum)
        return out

    def _apply_update(self) -> tuple[Any, bool]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.clip if self.clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # The norm is global (DDP's gradients are all-reduced); the ranks still agree on a flag, so that
        # no rank can step alone. One small flag read per step, unavoidable: whether optimizer.step()
        # runs is host control flow.
        skipped = dist.any_rank(~torch.isfinite(norm))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    def master_bytes(self) -> int:
        return 0

    def _save_state(self, folder: str) -> None:
        """Rank 0 writes the whole model and optimizer state (every rank holds the same)."""
        if not self.accelerator.is_main_process:
            return
        os.makedirs(folder, exist_ok=True)
        torch.save(self.unwrapped_model().state_dict(), os.path.join(folder, DDP_MODEL_FILE))
        torch.save(self.optimizer.state_dict(), os.path.join(folder, DDP_OPTIMIZER_FILE))
        save_plain_layout(self.unwrapped_model(), self.base_optimizer, folder)

    def _load_state(self, folder: str, saved_world_size: int) -> None:
        if not os.path.exists(os.path.join(folder, DDP_MODEL_FILE)):
            raise RuntimeError(f"{folder} holds no DDP state ({DDP_MODEL_FILE}); was this checkpoint written "
                               "with --deepspeed? Resume with the same launcher options")
        state = torch.load(os.path.join(folder, DDP_MODEL_FILE), map_location="cpu", weights_only=True)
        self.unwrapped_model().load_state_dict(state)
        saved = torch.load(os.path.join(folder, DDP_OPTIMIZER_FILE), map_location="cpu", weights_only=True)
        # MuonAdamW orders parameters by world size: renumber the saved state by name
        self.optimizer.load_state_dict(
            optimizer_state_by_name(saved, folder, self.unwrapped_model(), self.base_optimizer))
