"""What a dataset is to the code that reads it: `WindowSource`.

Two classes satisfy it: data/dataset.py's EpisodeDataset (a window is (episode position, condition
frame)) and data/cache.py's CachedDataset (a window is a row number); a reader never looks inside a
window, it hands back what `draw` or `val_windows` gave. It lives in `utils` because readers in both
peers of layer 1 take a dataset: `data` (the train stream and the validation loader, data/stream.py)
and `models` (the tiny VAE's fit, models/tiny_assets.py).
"""
from typing import Any, Protocol, TypeVar

import numpy as np

Window = TypeVar("Window")


class WindowSource(Protocol[Window]):
    """A set of sample windows: drawn with a seeded generator (training), listed (validation), loaded."""

    def __len__(self) -> int:
        """The number of windows."""
        ...

    def draw(self, rng: np.random.Generator, /) -> Window:
        """One training window, a pure function of the generator's state."""
        ...

    def val_windows(self) -> list[Window]:
        """The fixed windows validation walks."""
        ...

    def load(self, window: Window, /) -> dict[str, Any]:
        """One sample: DataBatch's field names (utils/batch.py) without the batch dimension; raises
        data.errors.DataError naming the file and episode of an unreadable window."""
        ...
