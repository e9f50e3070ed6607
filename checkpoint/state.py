"""What a checkpoint holds: the parts of a run's state, each registered once with a `Registry`; the
Checkpointer saves and restores every registered part without knowing what it is.

A part is anything with `save(where)` and `load(where, saved_world_size)` (`Part`): `where` is the
checkpoint folder joined with the part's name, and `saved_world_size` the number of ranks that wrote
the checkpoint (its manifest records it, once). Most state is a `Stateful` (`state_dict()` /
`load_state_dict()`, as torch objects have), stored by one of these adapters:
- `Shared(obj)`: a plain-JSON state, the same on every rank (step counters, the data position, the lr
  schedule): rank 0 writes `{name}.json`;
- `PerRank(obj)`: a state each rank has its own of (the RNG): every rank writes `{name}/rank_{r}.pt`;
  restored only at the world size that wrote it (another world size draws other streams anyway);
- `Document(write)`: a file written for readers of the checkpoint (config.yaml, norm_stats.json): saved,
  never restored.
The engine is a `Part` itself: its state is files every rank writes collectively (DeepSpeed shards).
"""
import json
import os
import random
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch

from checkpoint import disk
from utils import dist

PER_RANK_FILE = "rank_{rank}.pt"
PER_RANK_PATTERN = r"(?:^|/)rank_(\d+)\.pt"
"""The files of a PerRank part; the rank in the name wrote them (and checksums them)."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Part(Protocol):
    def save(self, where: str) -> None:
        """Collective: called on every rank; writes this part's files at `where` (a path without extension)."""

    def load(self, where: str, saved_world_size: int) -> None:
        """Collective: restore this part from the files `save` wrote at `where`."""


class Shared:
    """A state that is plain JSON and the same on every rank: rank 0 writes `{where}.json`."""

    def __init__(self, obj: Stateful) -> None:
        self.obj = obj

    def save(self, where: str) -> None:
        if dist.is_main():
            disk.fsync_write(where + ".json", json.dumps(self.obj.state_dict(), indent=1))

    def load(self, where: str, saved_world_size: int) -> None:
        with open(where + ".json") as f:
            self.obj.load_state_dict(json.load(f))


class PerRank:
    """A state each rank holds its own of: every rank writes `{where}/rank_{r}.pt`."""

    def __init__(self, obj: Stateful) -> None:
        self.obj = obj

    def save(self, where: str) -> None:
        os.makedirs(where, exist_ok=True)
        torch.save(self.obj.state_dict(), os.path.join(where, PER_RANK_FILE.format(rank=dist.rank())))

    def load(self, where: str, saved_world_size: int) -> None:
        mine = os.path.join(where, PER_RANK_FILE.format(rank=dist.rank()))
        if saved_world_size == dist.world_size() and os.path.exists(mine):
            self.obj.load_state_dict(torch.load(mine, weights_only=False))  # RNG states are numpy objects


class Document:
    """A file for the checkpoint's readers, written by rank 0 with `write(path)`; nothing to restore."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write = write

    def save(self, where: str) -> None:
        if dist.is_main():
            self.write(where)

    def load(self, where: str, saved_world_size: int) -> None:
        return None


class RandomState:
    """The python, numpy and torch (and CUDA) random generators of this process."""

    def state_dict(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class Registry:
    """The parts of a checkpoint by name, saved and restored in the order they were registered (a part
    that draws random numbers while it loads is registered before the RNG)."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[Part, bool]] = {}

    def register(self, name: str, part: Part, restore: bool = True) -> None:
        """Add `part` as `name` (its file or folder in the checkpoint). `restore=False`: saved, but left
        as it is on resume (resume.reset_optimizer, resume.reset_scheduler)."""
        if name in self._parts:
            raise ValueError(f"checkpoint part '{name}' is registered twice; each part is registered once")
        self._parts[name] = (part, restore)

    def __iter__(self) -> Iterator[tuple[str, Part]]:
        return ((name, part) for name, (part, _) in self._parts.items())

    def restored(self) -> Iterator[tuple[str, Part]]:
        return ((name, part) for name, (part, restore) in self._parts.items() if restore)
