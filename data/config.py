"""Config of the robot dataset (the `dataset` section)."""
from dataclasses import dataclass, field
from typing import Any, List, Optional

DATASET_TYPES = ("lerobot", "robotwin", "synthetic", "latent_action")
NORMALIZATIONS = ("mean_std", "min_max", "quantile", "none")
"""dataset.normalization: data/normalize.py implements each."""
DATA_MODES = ("clean", "randomized", "both")
"""dataset.data_mode of the RoboTwin layout (data/robotwin.py)."""
TASK_MODES = ("single", "multi")
"""dataset.task_mode of the RoboTwin layout."""
FRAME_LAYOUTS = ("tile", "robotwin")
"""dataset.frame_layout: how the cameras become the model's picture (data/transforms.compose_frames)."""


@dataclass
class SyntheticConfig:
    """The generated dataset of the default recipe (written in LeRobot v3.0 layout)."""
    num_episodes: int = 24
    """Episodes to generate."""
    episode_length: int = 80
    """Frames per episode."""
    fps: int = 30
    """Frames per second recorded in meta/info.json."""
    image_height: int = 48
    """Camera frame size; the squares (action_dim / 2 of them) move inside it."""
    image_width: int = 64
    """Width of the generated camera images."""
    seed: int = 0
    """Generator seed: the same seed gives the same dataset, frame for frame."""


@dataclass
class DatasetConfig:
    type: str = "synthetic"
    """lerobot, robotwin, synthetic or latent_action."""
    dataset_dir: Any = "assets/synthetic"
    """A folder, or a list of folders to mix (see `weights`)."""
    weights: Optional[List[float]] = None
    """Sampling weight of each folder in `dataset_dir`; null: proportional to size."""
    image_keys: Optional[List[str]] = None
    """Camera features to use; null: every camera feature in meta/info.json."""
    state_key: str = "observation.state"
    """Feature (parquet column) holding the state; also its key in the statistics JSON."""
    action_key: str = "action"
    """Feature holding the actions (latent_action: the key of the latent actions' statistics)."""
    instruction: Optional[str] = None
    """Instruction used when the dataset has no tasks."""
    val_episodes: Optional[List[int]] = None
    """Episode indices held out for validation; null: the last `val_fraction` of episodes."""
    val_fraction: float = 0.1
    """Share of each folder's episodes (its last ones) held out when val_episodes is null; 0: none."""
    normalization: str = "mean_std"
    """mean_std, min_max, quantile or none."""
    stats_path: Optional[str] = None
    """JSON from `python -m data.compute_stats`; null: computed from the dataset at start."""
    cache_dir: Optional[str] = None
    """Latent/text-embedding cache from `python -m data.build_cache`; null: encode online."""
    skip_bad_samples: bool = False
    """Skip (and count) unreadable samples instead of failing."""
    max_episodes: Optional[int] = None
    """Use only the first N episodes of each folder (debugging)."""
    data_mode: str = "both"
    """robotwin: clean, randomized or both."""
    task_mode: str = "multi"
    """robotwin: single or multi."""
    task_name: Optional[str] = None
    """robotwin: the task in single mode."""
    frame_layout: str = "tile"
    """How the cameras become the model's picture: tile (side by side, fitted with torch's antialiased
    bilinear resize) or robotwin (Motus's RoboTwin picture, data/robotwin_frame.py: head on top, the two wrists
    at half size below, OpenCV-exact resize_with_padding; 3 cameras in the order head, left wrist, right wrist,
    or 1 view Motus's converter already composed). inference.serve and the RoboTwin policy use the same."""
    pad_episode_end: bool = False
    """Windows also start in the last span of an episode, reading past its end as the robot holding its
    final pose (the last frame, action and state repeated): with long chunks, the end of a demonstration
    (the hand-over, the release) is otherwise never a condition frame."""
    relative_action_dims: Optional[List[int]] = None
    """Action dimensions learned and served as their distance from the same dimension of the condition
    frame's state (openpi's delta joint actions; data/normalize.py); null: every action absolute. The
    indices must name the same joint in the action and the state."""
    relative_action_horizon: Optional[int] = None
    """With relative_action_dims: the chunk's action at which they have become absolute. The distance
    from the state fades linearly from the first action (all state) to this one (none; data/normalize.py),
    so a new chunk starts where the arm is and ends where the picture says. null: the whole chunk relative."""
    cache_stride: Optional[int] = None
    """build_cache: raw frames between the condition frames of cached windows; null: the span of
    one predicted frame (video_action_freq_ratio * global_downsample_rate)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
