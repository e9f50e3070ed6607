"""The train stream (infinite, resumable, sharded) and the validation loader (finite, sharded).

Train: batch k of rank r holds sample numbers n = offset + (k * world_size + r) * batch_size + b
(offset 0 in a fresh run), and sample n is a pure function of (training.seed, n) (see
TrainDraws). The stream's state is the number of batches handed to the caller, so DataLoader
workers may prefetch as much as they like: after `load_state_dict` the stream restarts its
workers at that batch and yields exactly the batches the uninterrupted run would have yielded.
The position is kept in samples: resumed with another batch size, gradient accumulation or
world size, the stream continues at the first sample the saved run had not drawn.
"""
import logging
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from data.dataset import FixedWindows, TrainDraws
from data.worker_signals import worker_init_fn, workers_started_blocked
from utils.batch import DataBatch
from utils.window_source import WindowSource

logger = logging.getLogger(__name__)
_REPORTED = 20  # bad-sample messages kept for the report


def collate(samples: Sequence[dict[str, Any]]) -> DataBatch:
    """Sample dicts (data/dataset.py, data/cache.py: DataBatch's field names without the batch dimension) ->
    a DataBatch (tensors stacked, strings listed, numbers as int64), checked against the contract."""
    fields: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], torch.Tensor):  # numpy: no intra-op thread start-up per batch
            fields[key] = torch.from_numpy(np.stack([v.numpy() for v in values]))
        elif isinstance(values[0], str):
            fields[key] = values
        else:
            fields[key] = torch.tensor(values, dtype=torch.int64)
    return DataBatch.from_dict(fields)


def collate_reporting(samples: Sequence[dict[str, Any]]) -> tuple[DataBatch, list[str]]:
    """The DataLoader's collate: the batch and the errors of the bad samples replaced in it (key "_bad")."""
    bad = [m for s in samples for m in s.get("_bad", [])]
    return collate([{k: v for k, v in s.items() if k != "_bad"} for s in samples]), bad


class _BatchNumbers:
    """Batch sampler: lists of sample numbers for batches start, start + 1, ... forever."""

    def __init__(self, start: int, rank: int, world_size: int, batch_size: int, offset: int = 0) -> None:
        self.start, self.rank, self.world_size, self.batch_size = start, rank, world_size, batch_size
        self.offset = offset

    def __iter__(self) -> Iterator[list[int]]:
        k = self.start
        while True:
            first = self.offset + (k * self.world_size + self.rank) * self.batch_size
            yield list(range(first, first + self.batch_size))
            k += 1


class BadSampleLog:
    """Counts skipped samples and keeps the latest messages; each one is logged as a warning."""

    def __init__(self) -> None:
        self.count = 0
        self.messages: list[str] = []

    def take(self, loaded: tuple[DataBatch, list[str]]) -> DataBatch:
        batch, bad = loaded
        for message in bad:
            self.count += 1
            self.messages = (self.messages + [message])[-_REPORTED:]
            logger.warning("skipped a bad sample (%d so far): %s", self.count, message)
        return batch


class TrainStream:
    """`next(stream)` -> batch; `state_dict()` / `load_state_dict()` for exact resume."""

    def __init__(self, dataset: WindowSource[Any], seed: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, pin_memory: bool = False, skip_bad_samples: bool = False) -> None:
        self.draws = TrainDraws(dataset, seed, skip_bad_samples)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.batches = 0
        self.offset = 0  # samples before batch 0: a resume with another batch geometry (see load_state_dict)
        self.bad = BadSampleLog()
        self._iterator: Iterator[tuple[DataBatch, list[str]]] | None = None

    def __iter__(self) -> "TrainStream":
        return self

    def __next__(self) -> DataBatch:
        if self._iterator is None:
            with workers_started_blocked():
                self._iterator = iter(self._loader())
        batch = next(self._iterator)
        self.batches += 1
        return self.bad.take(batch)

    def _loader(self) -> torch.utils.data.DataLoader:
        sampler = _BatchNumbers(self.batches, self.rank, self.world_size, self.batch_size, self.offset)
        return torch.utils.data.DataLoader(
            self.draws, batch_sampler=sampler, num_workers=self.num_workers, collate_fn=collate_reporting,
            pin_memory=self.pin_memory and torch.cuda.is_available(), worker_init_fn=worker_init_fn,
            prefetch_factor=2 if self.num_workers else None)

    @property
    def skipped(self) -> int:
        return self.bad.count

    def state_dict(self) -> dict[str, Any]:
        # the position in samples: continued at any world size and batch size (the checkpoint's manifest
        # records the world size that wrote it)
        return {"batches_consumed": self.batches, "samples_consumed": self.samples_consumed(), "seed": self.draws.seed,
                "batch_size": self.batch_size, "skipped": self.bad.count}

    def samples_consumed(self) -> int:
        """Samples drawn by all ranks together: the next one is sample number samples_consumed()."""
        return self.offset + self.batches * self.world_size * self.batch_size

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position in samples, whatever batch size and world size saved it."""
        self.batches, self.offset = divmod(int(state["samples_consumed"]), self.world_size * self.batch_size)
        self.bad.count = int(state["skipped"])
        self._iterator = None  # restart the workers at the restored position

    def close(self) -> None:
        self._iterator = None


class ValLoader:
    """A finite, re-iterable loader over this rank's share of the validation windows.

    The windows are padded (wrapping around) to a multiple of world_size so every rank runs
    the same number of batches: validation makes collective calls on every rank. Its workers are
    forked once, at the first validation, and kept (persistent_workers): a fork at every validation
    (every system.val_interval steps) sometimes froze the forked child for good in CPython 3.11's
    after-fork thread clean-up while another thread of the rank held the interpreter's thread lock,
    and the rank then waited for its validation batch forever.
    """

    def __init__(self, dataset: WindowSource[Any], batch_size: int, rank: int, world_size: int, num_workers: int = 0,
                 skip_bad_samples: bool = False) -> None:
        windows = dataset.val_windows()
        if not windows:
            raise ValueError("validation set has no window long enough")
        per_rank = -(-len(windows) // world_size)
        padded = [windows[i % len(windows)] for i in range(per_rank * world_size)]
        self.windows = padded[rank::world_size]
        self.data = FixedWindows(dataset, self.windows, skip_bad_samples)
        self.bad = BadSampleLog()
        self.loader = torch.utils.data.DataLoader(self.data, batch_size=batch_size, shuffle=False,
                                                  num_workers=num_workers, collate_fn=collate_reporting,
                                                  worker_init_fn=worker_init_fn, persistent_workers=num_workers > 0)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[DataBatch]:
        with workers_started_blocked():
            batches = iter(self.loader)
        for batch in batches:
            yield self.bad.take(batch)
