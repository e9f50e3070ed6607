"""Exponential moving average (EMA) of the trainable weights, for validation, export and sampling.

Under ZeRO-1/2 each rank already owns a slice of the fp32 master weights (one flat partition per
param group) and updates only that slice; the EMA is one more fp32 tensor per partition, shaped
like it, updated right after each optimizer step with `ema.lerp_(master, 1 - d)`: no
communication, 4 bytes per trainable parameter / W per rank. Under DDP and DeepSpeed stage 0
(fp32) the optimizer updates whole parameters, and the EMA is an ordinary fp32 copy of them.

Schedule (`training.ema`): updates after optimizer steps s >= start_step with
(s - start_step) % update_every == 0; update n (n = updates so far) uses the decay
d_n = min(decay, (1 + n) / (10 + n)), except the first (n = 0), which copies the weights.

Validation swaps the EMA into the masters (the raw weights wait in the EMA's buffers), refreshes
the module's weights the way an optimizer step does (DeepSpeed's all-gather of the partitions),
validates and swaps back: no rank ever holds a second full copy of the model.
"""
import contextlib
import logging
import os
from typing import TYPE_CHECKING, Iterator, Mapping, Optional, Sequence

import torch
from omegaconf import DictConfig

from checkpoint.files import EMA_FILE, EMA_SHARD_FILE
from checkpoint.zero import CheckpointConvertError, ema_partitions_from
from optim.deepspeed_adapter import DeepSpeedRuntime, refresh_module_weights
from utils import dist

if TYPE_CHECKING:
    from train.engine import Engine  # which holds an EMA: imported for the type only

log = logging.getLogger(__name__)

SWAP_CHUNK = 1 << 24  # elements swapped at a time: the swap's temporary buffer stays under 64 MiB


def decay_at(settings: DictConfig, n: int) -> float:
    """The decay of EMA update number n (0-based)."""
    return 0.0 if n == 0 else min(settings.decay, (1 + n) / (10 + n))


def updates_at(settings: DictConfig, step: int) -> bool:
    """Whether the EMA is updated after optimizer step `step` (1-based)."""
    return step >= settings.start_step and (step - settings.start_step) % settings.update_every == 0


class EMA:
    """The EMA of `masters`, the fp32 tensors the optimizer updates in place.

    `names` (whole parameters, DDP / stage 0) or `zero_engine` (the DeepSpeed engine whose ZeRO
    partitions `masters` are) say how the EMA is saved, loaded and swapped into the model.
    """

    def __init__(self, settings: DictConfig, masters: Sequence[torch.Tensor], names: Optional[list[str]] = None,
                 zero_engine: Optional[DeepSpeedRuntime] = None) -> None:
        for m in masters:
            if m.dtype != torch.float32 or not m.is_contiguous():
                raise ValueError(f"EMA needs contiguous fp32 master weights, got {m.dtype} "
                                 f"(contiguous: {m.is_contiguous()})")
        self.settings, self.masters, self.zero_engine = settings, masters, zero_engine
        self.names = names or []  # read only without zero_engine
        self.shadow = [m.detach().clone() for m in masters]
        self.updates = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow)

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Call after optimizer step `step` on every rank (no communication)."""
        if not updates_at(self.settings, step):
            return
        d = decay_at(self.settings, self.updates)
        if d == 0.0:
            torch._foreach_copy_(self.shadow, self.masters)
        else:
            torch._foreach_lerp_(self.shadow, self.masters, 1.0 - d)
        self.updates += 1

    @torch.no_grad()
    def _swap(self) -> None:
        for a, b in zip(self.masters, self.shadow):
            for x, y in zip(a.view(-1).split(SWAP_CHUNK), b.view(-1).split(SWAP_CHUNK)):
                tmp = x.clone()
                x.copy_(y)
                y.copy_(tmp)
        if self.zero_engine is not None:
            refresh_module_weights(self.zero_engine)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Collective (under ZeRO): the model computes with the EMA weights inside the block."""
        self._swap()
        try:
            yield
        finally:
            self._swap()  # exact: the raw fp32 masters come back bit for bit, the module's weights from them

    # --- checkpoint files ------------------------------------------------------
    def save(self, engine_dir: str) -> None:
        """Collective: under ZeRO every rank writes its slice, else rank 0 writes the whole EMA."""
        os.makedirs(engine_dir, exist_ok=True)
        if self.zero_engine is not None:
            torch.save({"updates": self.updates, "partitions": self.shadow},
                       os.path.join(engine_dir, EMA_SHARD_FILE.format(rank=dist.rank())))
        elif dist.is_main():
            torch.save({"updates": self.updates, "weights": dict(zip(self.names, self.shadow))},
                       os.path.join(engine_dir, EMA_FILE))

    @torch.no_grad()
    def load(self, engine_dir: str, saved_world_size: int) -> None:
        """Restore the EMA of a checkpoint written by `saved_world_size` ranks; at another world size
        (ZeRO) re-partitioned by name."""
        whole = os.path.join(engine_dir, EMA_FILE)
        mine = os.path.join(engine_dir, EMA_SHARD_FILE.format(rank=dist.rank()))
        first = os.path.join(engine_dir, EMA_SHARD_FILE.format(rank=0))
        if not os.path.isfile(whole if self.zero_engine is None else first):
            log.warning("%s holds no EMA (saved without training.ema.enabled): the EMA starts again, "
                        "from a copy of the weights at its next update", engine_dir)
            self.updates = 0
            return
        if self.zero_engine is None:
            saved = torch.load(whole, map_location="cpu", weights_only=True)
            parts = [self._named(saved["weights"], name, engine_dir) for name in self.names]
        elif saved_world_size == dist.world_size() and os.path.isfile(mine):
            saved = torch.load(mine, map_location="cpu", weights_only=True)
            parts = saved["partitions"]
        else:
            saved = {}
            saved["updates"], parts = ema_partitions_from(self.zero_engine, engine_dir)
        if [p.shape for p in parts] != [t.shape for t in self.shadow]:
            raise CheckpointConvertError(f"{engine_dir}: the saved EMA has shapes {[tuple(p.shape) for p in parts]}, "
                                         f"this run's {[tuple(t.shape) for t in self.shadow]}")
        torch._foreach_copy_(self.shadow, [p.to(t.device) for p, t in zip(parts, self.shadow)])
        self.updates = int(saved["updates"])

    @staticmethod
    def _named(weights: Mapping[str, torch.Tensor], name: str, engine_dir: str) -> torch.Tensor:
        if name not in weights:
            raise CheckpointConvertError(f"{os.path.join(engine_dir, EMA_FILE)} has no EMA of '{name}'; "
                                         "resume needs the same model")
        return weights[name]


def optimizer_state_report(engine: "Engine") -> str:
    """One line: the optimizer-state bytes this rank holds (fp32 masters under ZeRO, the optimizer's
    own state, the EMA) for a train.engine.Engine. Read after the first step, when the optimizer has
    created its state."""
    base = engine.base_optimizer
    own = sum(t.numel() * t.element_size() for s in base.state.values() for t in s.values()
              if torch.is_tensor(t) and t.dim() > 0)
    masters = engine.master_bytes()
    ema = engine.ema.nbytes if engine.ema is not None else 0
    mib = 2 ** 20
    return (f"optimizer state on rank {dist.rank()} of {dist.world_size()}: {(own + masters + ema) / mib:.2f} MiB "
            f"(fp32 master partitions {masters / mib:.2f}, optimizer state {own / mib:.2f}, EMA {ema / mib:.2f}; "
            f"bytes {own + masters + ema}, EMA bytes {ema})")
