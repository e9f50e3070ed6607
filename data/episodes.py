"""Episodes as every reader hands them over, the sampling window, and the train/val split.

A window (docs/architecture.md, "The sampling window"), with d = global_downsample_rate, r = video_action_freq_ratio
and F = num_video_frames: condition frame c; actions at c + (i+1) d for i < F r; video frames
c and c + (j+1) r d for j < F (each predicted frame lines up with the last action of its
slice); state at c. The last index used is c + F r d, so c ranges over [0, length - 1 - F r d]
and a window never reads past its episode's end.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from omegaconf import DictConfig


@dataclass
class Episode:
    """One episode: numeric columns in memory, frames read on demand."""
    source: int
    """Index of the dataset folder (or task group) the episode comes from."""
    index: int
    """The episode's own index in its folder (LeRobot `episode_index`)."""
    length: int
    action: np.ndarray
    """[length, action_dim] float32."""
    state: Optional[np.ndarray]
    """[length, state_dim] float32, or None (latent-action pretraining data)."""
    timestamps: np.ndarray
    """[length] seconds from the episode start (LeRobot `timestamp`)."""
    task_ids: np.ndarray
    """[length] index into `tasks` of the instruction at each frame."""
    tasks: List[str]
    videos: Dict[str, Tuple[str, float]] = field(default_factory=dict)
    """camera key -> (mp4 path, time of the episode's first frame in that file)."""
    images: Dict[str, Tuple[str, np.ndarray]] = field(default_factory=dict)
    """camera key -> (parquet path, row of each frame): cameras stored as images in the parquet."""
    fps: float = 30.0
    origin: str = ""
    """File that holds the episode's numeric data (for error messages)."""

    def describe(self) -> str:
        return f"episode {self.index} of {self.origin}"


@dataclass(frozen=True)
class WindowSpec:
    num_video_frames: int
    downsample: int
    ratio: int
    pad_end: bool = False
    """Windows read past the episode's end as its last frame held (dataset.pad_episode_end)."""

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "WindowSpec":
        c = cfg.common
        return cls(c.num_video_frames, c.global_downsample_rate, c.video_action_freq_ratio,
                   bool(cfg.dataset.pad_episode_end))

    @property
    def span(self) -> int:
        """Raw frames from the condition frame to the last action and video frame."""
        return self.num_video_frames * self.ratio * self.downsample

    def num_windows(self, length: int) -> int:
        """Condition frames of an episode: those whose window fits, or with pad_end every frame
        followed by at least one action."""
        return max(0, length - (self.downsample if self.pad_end else self.span))

    def clip(self, indices: np.ndarray, length: int) -> np.ndarray:
        """`indices` of one window with those past the episode's end held at its last frame."""
        return np.minimum(indices, length - 1)

    def action_indices(self, c: int) -> np.ndarray:
        steps = self.num_video_frames * self.ratio
        return c + (np.arange(steps) + 1) * self.downsample

    def video_indices(self, c: int) -> np.ndarray:
        return np.concatenate([[c], c + (np.arange(self.num_video_frames) + 1) * self.ratio * self.downsample])


def split_episodes(indices: Sequence[int], val_episodes: Sequence[int] | None,
                   val_fraction: float) -> tuple[list[int], list[int]]:
    """(train, val) episode indices of one folder: `val_episodes` if given, else the last fraction."""
    indices = sorted(indices)
    if val_episodes is not None:
        held = set(val_episodes)
    elif val_fraction > 0 and len(indices) > 1:
        count = min(len(indices) - 1, max(1, int(round(val_fraction * len(indices)))))
        held = set(indices[-count:])
    else:
        held = set()
    return [i for i in indices if i not in held], [i for i in indices if i in held]
