"""Exponential moving average (EMA) of the trainable weights, for validation, export and sampling.

The EMA is one fp32 tensor per master tensor the optimizer updates in place, updated by the engine right
after each applied optimizer step (train/engine.py `Engine.optimizer_step`) with
`ema.lerp_(master, 1 - d)`: no communication. What the masters are, and so how the EMA is saved,
loaded and shown to the model, is the engine's: whole parameters under DDP and DeepSpeed stage 0
(train/engine.py), this rank's ZeRO-1/2 partition of each param group under ZeRO (4 bytes per
trainable parameter / W per rank; train/deepspeed_engine.py).

Schedule (`training.ema`): updates after optimizer steps s >= start_step with
(s - start_step) % update_every == 0; update n (n = updates so far) uses the decay
d_n = min(decay, (1 + n) / (10 + n)), except the first (n = 0), which copies the weights.

Validation swaps the EMA into the masters (the raw weights wait in the EMA's buffers), lets the engine
refresh the module's weights from them (DeepSpeed's all-gather of the partitions), validates and swaps
back: no rank ever holds a second full copy of the model.
"""
import contextlib
from typing import Callable, Iterator, Sequence

import torch
from omegaconf import DictConfig

from checkpoint.zero import CheckpointConvertError

SWAP_CHUNK = 1 << 24  # elements swapped at a time: the swap's temporary buffer stays under 64 MiB


def decay_at(settings: DictConfig, n: int) -> float:
    """The decay of EMA update number n (0-based)."""
    return 0.0 if n == 0 else min(settings.decay, (1 + n) / (10 + n))


def updates_at(settings: DictConfig, step: int) -> bool:
    """Whether the EMA is updated after optimizer step `step` (1-based)."""
    return step >= settings.start_step and (step - settings.start_step) % settings.update_every == 0


class EMA:
    """The EMA of `masters`, the fp32 tensors the optimizer updates in place."""

    def __init__(self, settings: DictConfig, masters: Sequence[torch.Tensor]) -> None:
        for m in masters:
            if m.dtype != torch.float32 or not m.is_contiguous():
                raise ValueError(f"EMA needs contiguous fp32 master weights, got {m.dtype} "
                                 f"(contiguous: {m.is_contiguous()})")
        self.settings, self.masters = settings, masters
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

    @contextlib.contextmanager
    def swapped_in(self, refresh: Callable[[], None] = lambda: None) -> Iterator[None]:
        """The masters hold the EMA inside the block; `refresh` (collective under ZeRO) makes the
        module's weights follow the masters after each swap."""
        self._swap()
        refresh()
        try:
            yield
        finally:
            self._swap()  # exact: the raw fp32 masters come back bit for bit, the module's weights from them
            refresh()

    @torch.no_grad()
    def restore(self, updates: int, saved: Sequence[torch.Tensor], where: str) -> None:
        """Install a saved EMA (tensors shaped like this one's, in its order) from the files in `where`."""
        if [p.shape for p in saved] != [t.shape for t in self.shadow]:
            raise CheckpointConvertError(f"{where}: the saved EMA has shapes {[tuple(p.shape) for p in saved]}, "
                                         f"this run's {[tuple(t.shape) for t in self.shadow]}")
        torch._foreach_copy_(self.shadow, [p.to(t.device) for p, t in zip(saved, self.shadow)])
        self.updates = int(updates)
