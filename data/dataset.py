"""Samples from episodes: a window (data/episodes.py; TRAINING.md, "The sample window"), decoded, fitted, normalised.

A dataset here is a set of episodes plus the rules to turn a window (episode, condition
frame) into a sample. The train stream asks it to `draw` windows with a seeded generator;
the validation loader walks its fixed `val_windows`. Both go through `load`, which raises
DataError (naming file and episode) for anything unreadable. That interface is
utils/window_source.py's `WindowSource`, which data/cache.py's CachedDataset satisfies too.
"""
import numpy as np
import torch
from typing import Any, Sequence

from data.episodes import Episode, WindowSpec
from data.errors import DataError
from data.lerobot_format import ParquetImages
from data.normalize import NormStats
from data.transforms import compose_frames
from data.video import read_frames
from utils.window_source import Window, WindowSource


class EpisodeDataset:
    """Windows over a list of episodes, decoded from video on demand."""

    def __init__(self, episodes: Sequence[Episode], spec: WindowSpec, image_keys: Sequence[str], height: int,
                 width: int, stats: NormStats, instruction: str | None = None,
                 source_weights: Sequence[float] | None = None, frame_layout: str = "tile") -> None:
        self.spec, self.image_keys, self.height, self.width = spec, list(image_keys), height, width
        self.frame_layout = frame_layout
        self.stats, self.instruction = stats, instruction
        self._images = ParquetImages()
        self.episodes = [e for e in episodes if spec.num_windows(e.length) > 0]
        self.too_short = [e for e in episodes if spec.num_windows(e.length) == 0]
        sources = sorted({e.source for e in self.episodes})
        self._by_source = {s: [i for i, e in enumerate(self.episodes) if e.source == s] for s in sources}
        self._cumulative = {s: np.cumsum([spec.num_windows(self.episodes[i].length) for i in idx])
                            for s, idx in self._by_source.items()}
        self.sources = sources
        self.source_probs = self._probabilities(source_weights)
        self.bad_episodes: list[str] = []  # the unreadable episodes left out, set by data/build.py

    def _probabilities(self, source_weights: Sequence[float] | None) -> np.ndarray:
        if not self.sources:
            return np.zeros(0)
        if source_weights is None:  # proportional to size: every window equally likely
            w = np.array([self._cumulative[s][-1] for s in self.sources], dtype=np.float64)
        else:
            w = np.array([source_weights[s] for s in self.sources], dtype=np.float64)
        return w / w.sum()

    def __len__(self) -> int:
        return int(sum(c[-1] for c in self._cumulative.values()))

    def num_episodes(self) -> int:
        return len(self.episodes)

    # ---- windows ------------------------------------------------------------------------------
    def draw(self, rng: np.random.Generator) -> tuple[int, int]:
        """A window (episode position, condition frame): source by weight, then a window uniformly."""
        if not self.sources:
            raise DataError("no episode is long enough for one window "
                            f"({self.spec.span + 1} frames needed: num_video_frames * "
                            "video_action_freq_ratio * global_downsample_rate + 1)")
        source = self.sources[rng.choice(len(self.sources), p=self.source_probs)]
        cumulative = self._cumulative[source]
        k = int(rng.integers(cumulative[-1]))
        j = int(np.searchsorted(cumulative, k, side="right"))
        start = cumulative[j - 1] if j else 0
        return self._by_source[source][j], int(k - start)

    def val_windows(self) -> list[tuple[int, int]]:
        """Fixed windows for validation: non-overlapping condition frames of every episode."""
        windows: list[tuple[int, int]] = []
        for i, e in enumerate(self.episodes):
            windows.extend((i, int(c)) for c in range(0, self.spec.num_windows(e.length), self.spec.span))
        return windows

    def describe(self, window: tuple[int, int]) -> str:
        i, c = window
        return f"frame {c} of {self.episodes[i].describe()}"

    # ---- samples ------------------------------------------------------------------------------
    def load(self, window: tuple[int, int]) -> dict[str, Any]:
        """One sample: DataBatch's raw fields (utils/batch.py) without the batch dimension."""
        i, c = window
        ep = self.episodes[i]
        frames = self.spec.clip(self.spec.video_indices(c), ep.length)
        actions = ep.action[self.spec.clip(self.spec.action_indices(c), ep.length)]
        state = None if ep.state is None else self.stats.normalize_state(ep.state[c])
        sample = {
            "video": self._video(ep, frames),
            "actions": torch.from_numpy(np.array(self.stats.normalize_action(actions, state), dtype=np.float32)),
            "instruction": ep.tasks[ep.task_ids[c]] or (self.instruction or ""),
            "episode_index": ep.index,
            "frame_index": c,
        }
        if state is not None:
            sample["state"] = torch.from_numpy(np.array(state, dtype=np.float32))
        return sample

    def _video(self, ep: Episode, frames: np.ndarray) -> torch.Tensor:
        views = []
        for key in self.image_keys:
            if key in ep.images:
                path, rows = ep.images[key]
                views.append(self._images.read(path, key, rows[frames]))
                continue
            path, start = ep.videos[key]
            times = start + ep.timestamps[frames]
            try:
                views.append(read_frames(path, times.tolist(), tolerance=0.5 / ep.fps))
            except DataError as e:
                raise DataError(f"{ep.describe()}, camera {key}: {e}") from None
        if not views:
            raise DataError(f"{ep.describe()}: no camera to read (dataset.image_keys is empty)")
        try:
            return compose_frames(views, self.frame_layout, self.height, self.width)
        except ValueError as e:  # dataset.frame_layout robotwin given the wrong cameras
            raise DataError(f"{ep.describe()}: {e} (dataset.image_keys {self.image_keys})") from None


def try_load(dataset: WindowSource[Window], window: Window, skip: bool, errors: list[str]) -> dict[str, Any] | None:
    """The sample of `window` carrying the errors met so far (key "_bad"), or None when it is bad
    and bad samples are skipped (its error is appended to `errors`)."""
    try:
        sample = dataset.load(window)
    except DataError as e:
        if not skip:
            raise
        errors.append(str(e))
        return None
    sample["_bad"] = errors
    return sample


class TrainDraws(torch.utils.data.Dataset):
    """Sample number n -> a sample, the same on every run: windows drawn from rng(seed, n, attempt).

    With skip_bad_samples an unreadable window is replaced by the next attempt's draw and its
    error travels with the sample (key "_bad") so the stream can count and report it.
    """

    MAX_ATTEMPTS = 20

    def __init__(self, dataset: WindowSource[Any], seed: int, skip_bad_samples: bool) -> None:
        self.dataset, self.seed, self.skip = dataset, seed, skip_bad_samples

    def __len__(self) -> int:  # the stream is infinite; DataLoader only needs a number
        return 2 ** 62

    def __getitem__(self, n: int) -> dict[str, Any]:
        errors: list[str] = []
        for attempt in range(self.MAX_ATTEMPTS):
            window = self.dataset.draw(np.random.default_rng([self.seed, n, attempt]))
            sample = try_load(self.dataset, window, self.skip, errors)
            if sample is not None:
                return sample
        raise DataError(f"{self.MAX_ATTEMPTS} windows in a row could not be read (sample {n}); "
                        f"the dataset is mostly unreadable. Last error: {errors[-1]}")


class FixedWindows(torch.utils.data.Dataset):
    """A fixed list of windows (validation, cache building); a bad one is replaced by the next good one."""

    def __init__(self, dataset: WindowSource[Any], windows: Sequence[Any], skip_bad_samples: bool) -> None:
        self.dataset, self.windows, self.skip = dataset, list(windows), skip_bad_samples

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, k: int) -> dict[str, Any]:
        errors: list[str] = []
        for step in range(len(self.windows)):
            sample = try_load(self.dataset, self.windows[(k + step) % len(self.windows)], self.skip, errors)
            if sample is not None:
                return sample
        raise DataError(f"none of the {len(self.windows)} windows could be read. Last error: {errors[-1]}")
