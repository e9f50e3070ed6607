"""Per-channel statistics of a camera's frames, as LeRobot's own writer stores them in meta/stats.json
and in each episode's stats.

LeRobot's conventions (its `compute_episode_stats`, `sample_indices`, `auto_downsample_height_width`):
- a sample of each episode's frames: all of them below 100 frames, else max(100, min(int(n ** 0.75),
  10000)) of them, evenly spaced (`np.round(np.linspace(0, n - 1, count))`);
- a frame whose longer side is 300 pixels or more is strided by int(longer side / 150) in both axes;
- the statistics are per RGB channel of pixels scaled to [0, 1]: min, max, mean, std (ddof=0) and the
  quantiles q01, q10, q50, q90, q99, each shaped [3, 1, 1] (JSON: [[[r]], [[g]], [[b]]]); `count` is
  [the number of sampled frames].

The pixels are uint8, so a 256-bin histogram per channel holds everything exactly: histograms add
up over episodes, and min, max, mean, std and the quantiles (numpy's linear interpolation between
the two nearest ranks) are computed from one. The dataset's statistics are those of every episode's
sample together: for min, max, mean and std that is what LeRobot's `aggregate_stats` gives from the
episodes' statistics; for the quantiles it is the quantile of the pooled sample (LeRobot 0.4.4
averages the episodes' quantiles, weighted by their counts). LeRobot 0.4.4 squares uint8 pixels
before widening them, which wraps around and leaves its own std near 0; these are the true values.
"""
from typing import Any

import numpy as np

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
QUANTILE_KEYS = tuple(f"q{round(q * 100):02d}" for q in QUANTILES)
LEVELS = 256  # uint8 pixel values


def sample_indices(length: int) -> np.ndarray:
    """Which of an episode's `length` frames enter its statistics (LeRobot's sample)."""
    count = length if length < 100 else max(100, min(int(length ** 0.75), 10_000))
    return np.round(np.linspace(0, length - 1, count)).astype(int)


def sampled_pixels(frames: np.ndarray) -> np.ndarray:
    """uint8 frames [T, H, W, 3] -> the sampled, strided frames [S, h, w, 3] the statistics are of."""
    sample = frames[sample_indices(len(frames))]
    height, width = frames.shape[1:3]
    if max(height, width) >= 300:
        stride = int(max(height, width) / 150)
        sample = sample[:, ::stride, ::stride]
    return sample


def histogram(frames: np.ndarray, key: str) -> np.ndarray:
    """int64 [3, 256]: how many sampled pixels of each channel take each value. `key` names the camera
    in the error raised for frames that are not uint8 [T, H, W, 3] with T >= 1."""
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 \
            or len(frames) == 0:
        got = f"{frames.dtype} {list(frames.shape)}" if isinstance(frames, np.ndarray) else type(frames).__name__
        raise ValueError(f"camera '{key}': frames must be a uint8 array [frames, height, width, 3] (RGB) with at "
                         f"least one frame, got {got}")
    pixels = sampled_pixels(frames).reshape(-1, 3)
    return np.stack([np.bincount(pixels[:, c], minlength=LEVELS) for c in range(3)]).astype(np.int64)


def _quantile(counts: np.ndarray, q: float) -> float:
    """numpy's linear quantile of the values a histogram `counts` [256] describes."""
    below = np.cumsum(counts)
    total = int(below[-1])
    position = q * (total - 1)
    low = int(np.floor(position))
    # the k-th smallest value (from 0) is the first level with more than k values at or below it
    value_low = int(np.searchsorted(below, low, side="right"))
    value_high = int(np.searchsorted(below, min(low + 1, total - 1), side="right"))
    return float(value_low + (position - low) * (value_high - value_low))


def stats_from_histogram(hist: np.ndarray, frames: int) -> dict[str, Any]:
    """LeRobot's camera statistics ([3, 1, 1] lists in [0, 1]; count [frames]) of a histogram [3, 256]
    over `frames` sampled frames."""
    levels: np.ndarray = np.arange(LEVELS, dtype=np.float64)
    total = hist.sum(1).astype(np.float64)
    mean = hist @ levels / total
    var = (hist * (levels[None, :] - mean[:, None]) ** 2).sum(1) / total
    seen = hist > 0
    per_channel = {"min": seen.argmax(1).astype(np.float64),
                   "max": (LEVELS - 1 - seen[:, ::-1].argmax(1)).astype(np.float64),
                   "mean": mean, "std": np.sqrt(var)}
    for name, q in zip(QUANTILE_KEYS, QUANTILES):
        per_channel[name] = np.array([_quantile(hist[c], q) for c in range(3)])
    stats: dict[str, Any] = {name: (values / (LEVELS - 1)).reshape(3, 1, 1).tolist()
                             for name, values in per_channel.items()}
    stats["count"] = [int(frames)]
    return stats
