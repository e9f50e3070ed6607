"""The engine under DeepSpeed (ZeRO-0/1/2): DeepSpeed clips, steps and skips; its internals are read
through optim/deepspeed_adapter.py only."""
import os
from typing import Any

import torch

from checkpoint.files import EMA_SHARD_FILE
from checkpoint.zero import ema_partitions_from, reshard_if_needed, save_layout
from optim.deepspeed_adapter import (base_optimizer, count_skipped_step, fp32_partitions, guard_client_step,
                                     has_master_partitions, partition_groups, refresh_module_weights)
from train.ema import EMA
from train.engine import Engine, poison_nonfinite
from utils import dist
from utils.batch import FlowLosses, ModelBatch


def fp32_exempt_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters a bf16_mixed model keeps in fp32 (models/world_model.py FP32_PATTERNS: time
    embeddings and modulation tables), taken before DeepSpeed sees them; {} when none is fp32 beside bf16."""
    dtypes = {p.dtype for p in model.parameters()}
    if torch.bfloat16 not in dtypes:
        return {}
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype == torch.float32}


@torch.no_grad()
def restore_fp32_masters(ds: Any, weights: dict[str, torch.Tensor]) -> None:
    """DeepSpeed's bf16 engine casts every parameter of the module to bf16 at init (its keep_in_fp32 list
    covers buffers only), and ZeRO-1/2 then initialise the fp32 masters from those bf16 values. Write the
    fp32 values of `weights` (name -> tensor, `fp32_exempt_weights`) into this rank's master partitions, so
    the optimizer updates the loaded fp32 numbers, then refresh the module's bf16 copies from them (an
    all-gather, collective). The module still computes with bf16 copies of these tensors: TRAINING.md,
    "Precision"."""
    names = {id(p): n for n, p in ds.module.named_parameters()}
    for group in partition_groups(ds):
        begin, size = group.begin, group.partition_size
        for p, offset in zip(group.params, group.offsets):
            value = weights.get(names[id(p)])
            lo, hi = max(begin, offset), min(begin + size, offset + p.numel())
            if value is not None and lo < hi:  # the piece of this tensor that lies in this rank's partition
                group.master[lo - begin:hi - begin].copy_(value.reshape(-1)[lo - offset:hi - offset])
    refresh_module_weights(ds)


def _split(folder: str) -> tuple[str, str]:
    """(parent, tag): DeepSpeed saves into and loads from `parent/tag`."""
    folder = os.path.normpath(folder)
    return os.path.dirname(folder), os.path.basename(folder)


class DeepSpeedEngine(Engine):
    """DeepSpeed: it accumulates, clips and steps at the gradient-accumulation boundary and skips an
    update whose global gradient norm is not finite (ZeRO-1/2, its bf16 optimizer); without ZeRO in fp32
    it does not check, and this engine suppresses the client optimizer's step itself."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Any) -> None:
        super().__init__(accelerator, cfg)
        self._stage0_skipped = False  # DeepSpeed without ZeRO: this step's gradients were dropped
        exempt = fp32_exempt_weights(model)
        self.model, _ = accelerator.prepare(model, optimizer)
        self.ds = self.model  # DeepSpeed's own engine (DeepSpeedRuntime)
        if exempt and self.ds.bfloat16_enabled() and self.ds.zero_optimization():
            restore_fp32_masters(self.ds, exempt)
        self.base_optimizer = base_optimizer(self.ds)
        if not self.ds.zero_optimization():
            guard_client_step(self.base_optimizer, lambda: self._stage0_skipped)
        # ZeRO-1/2: the EMA follows this rank's fp32 master partitions, else the whole parameters
        self.partitioned = has_master_partitions(self.ds)
        if cfg.training.ema.enabled and self.partitioned:
            self.ema = EMA(cfg.training.ema, fp32_partitions(self.ds))
        else:
            self.ema = self.whole_parameter_ema(cfg.training.ema)

    def micro_step(self, inputs: ModelBatch, is_last: bool) -> FlowLosses:
        self.ds.set_gradient_accumulation_boundary(is_last)
        out = self.model(inputs)
        self.ds.backward(poison_nonfinite(out.loss))  # DeepSpeed divides by gradient_accumulation_steps
        if is_last and not self.ds.zero_optimization():
            self._check_stage0_grads()
        # a no-op except at the boundary: clip, update, zero grads; ZeRO-1/2 (and DeepSpeed's bf16
        # optimizer) skip the update when the global gradient norm is not finite
        self.ds.step()
        return out

    def _check_stage0_grads(self) -> None:
        """DeepSpeed without ZeRO in fp32 steps the client optimizer as it is, unchecked: when the
        gradients (whole, and the same on every rank after the all-reduce) are not finite, the
        client optimizer's step is suppressed for this step (`guard_client_step`)."""
        if self.ds.bfloat16_enabled() or self.ds.fp16_enabled():
            return  # DeepSpeed's own low-precision optimizers check the norm themselves
        grads = [p.grad for g in self.base_optimizer.param_groups for p in g["params"] if p.grad is not None]
        # one flag read: whether the update runs is decided on the host (as DeepSpeed's check does)
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item():
            self._stage0_skipped = True
            count_skipped_step(self.ds)  # DeepSpeed counts the step as taken; its skip counter agrees

    def _apply_update(self) -> tuple[Any, bool]:
        norm = self.ds.get_global_grad_norm()
        skipped = not self.ds.was_step_applied() or self._stage0_skipped
        self._stage0_skipped = False
        return (norm if norm is not None else float("nan")), skipped

    def master_bytes(self) -> int:
        if not self.partitioned:
            return 0
        return sum(t.numel() * t.element_size() for t in fp32_partitions(self.ds))

    def _save_state(self, folder: str) -> None:
        parent, tag = _split(folder)
        try:
            self.ds.save_checkpoint(parent, tag=tag, exclude_frozen_parameters=True)
        except Exception:
            # A write failed on this rank (a full disk): its writes come after save_checkpoint's
            # last collective but one, the closing barrier, which the other ranks are waiting in.
            # Meet them there, so that the caller's agreement on the failure is the next collective.
            dist.barrier()
            raise
        save_layout(self.ds, folder)

    def _load_state(self, folder: str, saved_world_size: int) -> None:
        if reshard_if_needed(self.ds, folder, saved_world_size):
            return
        parent, tag = _split(folder)
        path, _ = self.ds.load_checkpoint(parent, tag=tag, load_module_strict=False,
                                          load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the engine state in {folder}")

    # --- the EMA of ZeRO-1/2's partitions: each rank saves, loads and swaps its own slice -----------
    def _refresh_module_weights(self) -> None:
        if self.partitioned:
            refresh_module_weights(self.ds)  # the module's weights from the masters (all-gather)

    def _save_ema(self, folder: str) -> None:
        if not self.partitioned:
            return super()._save_ema(folder)
        assert self.ema is not None
        save_partitioned_ema(self.ema, folder)

    def _load_ema(self, folder: str, saved_world_size: int) -> None:
        if not self.partitioned:
            return super()._load_ema(folder, saved_world_size)
        assert self.ema is not None
        if not load_partitioned_ema(self.ema, self.ds, folder, saved_world_size):
            self._ema_restarts(folder)


def save_partitioned_ema(ema: EMA, folder: str) -> None:
    """Collective in effect: every rank writes the EMA of its own ZeRO-1/2 partitions."""
    os.makedirs(folder, exist_ok=True)
    torch.save({"updates": ema.updates, "partitions": ema.shadow},
               os.path.join(folder, EMA_SHARD_FILE.format(rank=dist.rank())))


def load_partitioned_ema(ema: EMA, ds: Any, folder: str, saved_world_size: int) -> bool:
    """This rank's slice of the EMA saved in `folder`; from a checkpoint of another world size,
    re-partitioned by parameter name like the fp32 masters. False when `folder` holds none."""
    mine = os.path.join(folder, EMA_SHARD_FILE.format(rank=dist.rank()))
    if not os.path.isfile(os.path.join(folder, EMA_SHARD_FILE.format(rank=0))):
        return False
    if saved_world_size == dist.world_size() and os.path.isfile(mine):
        saved = torch.load(mine, map_location="cpu", weights_only=True)
        ema.restore(saved["updates"], saved["partitions"], folder)
    else:
        ema.restore(*ema_partitions_from(ds, folder), folder)
    return True
