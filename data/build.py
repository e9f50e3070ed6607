"""build_datasets / build_train_stream / build_val_loader: the data part's entry points."""
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from omegaconf import DictConfig

from data.dataset import EpisodeDataset
from data.episodes import Episode, WindowSpec, split_episodes
from data.errors import DataError
from data.latent_action import load_latent_action
from data.lerobot_format import LeRobotSource
from data.normalize import NormStats, compute_feature_stats
from data.robotwin import CAMERA as ROBOTWIN_CAMERA, load_robotwin
from data.stream import TrainStream, ValLoader
from utils.window_source import WindowSource

if TYPE_CHECKING:
    from data.cache import CachedDataset

logger = logging.getLogger(__name__)


def dataset_dirs(dcfg: DictConfig) -> list[str]:
    dirs = dcfg.dataset_dir
    dirs = [dirs] if isinstance(dirs, str) else list(dirs)
    return [str(d) for d in dirs]


class BadEpisodes:
    """Raise on the first unreadable episode, or (skip_bad_samples) collect and report them."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip
        self.messages: list[str] = []

    def __call__(self, message: str) -> None:
        if not self.skip:
            raise DataError(message + " (set dataset.skip_bad_samples: true to skip bad episodes)")
        self.messages.append(message)
        logger.warning("skipping a bad episode: %s", message)


def load_episodes(dcfg: DictConfig, on_bad: Callable[[str], None],
                  with_video: bool = True) -> tuple[list[Episode], list[str], list[float] | None]:
    """(episodes, image_keys, source_weights) for any dataset.type."""
    dirs = dataset_dirs(dcfg)
    if dcfg.type == "robotwin":
        if len(dirs) != 1:
            raise DataError(f"dataset.type robotwin reads one folder; dataset_dir is {dirs}")
        robotwin, tasks = load_robotwin(dirs[0], dcfg.data_mode, dcfg.task_mode, dcfg.task_name,
                                        dcfg.max_episodes, on_bad)
        return robotwin, [ROBOTWIN_CAMERA], [1.0] * len(tasks)  # tasks weighted equally, as in Motus
    weights = _weights(dcfg)
    episodes: list[Episode] = []
    image_keys: list[str] | None = None
    for source, root in enumerate(dirs):
        if dcfg.type == "latent_action":
            episodes += load_latent_action(root, source, dcfg.max_episodes, on_bad, numeric_only=not with_video)
            image_keys = ["video"]
            continue
        reader = LeRobotSource(root, source, dcfg.state_key, dcfg.action_key,
                               image_keys=dcfg.image_keys if with_video else [], max_episodes=dcfg.max_episodes)
        if image_keys is not None and reader.image_keys != image_keys:
            raise DataError(f"{root} has cameras {reader.image_keys} but {dirs[0]} has {image_keys}; "
                            "set dataset.image_keys to cameras every folder has")
        image_keys = reader.image_keys
        episodes += reader.load(on_bad)
    return episodes, image_keys or [], weights


def _weights(dcfg: DictConfig) -> list[float] | None:
    """One weight per folder (recipe/config.py checks their count and signs), or None: by size."""
    return None if dcfg.weights is None else list(dcfg.weights)


def check_dims(episodes: Sequence[Episode], cfg: DictConfig) -> None:
    """The data's action/state widths must match common.action_dim/state_dim."""
    for key, attr, want in (("action", "action", cfg.common.action_dim), ("state", "state", cfg.common.state_dim)):
        for ep in episodes:
            values = getattr(ep, attr)
            if values is not None and values.shape[1] != want:
                raise DataError(f"{ep.describe()}: {key} has dimension {values.shape[1]} but "
                                f"common.{key}_dim is {want}; set common.{key}_dim: {values.shape[1]} "
                                f"or point dataset.{key}_key at another feature")


def stats_from_episodes(episodes: Sequence[Episode], action_key: str, state_key: str) -> dict[str, dict[str, Any]]:
    """Statistics pooled over every frame of every episode (what compute_stats writes)."""
    if not episodes:
        raise DataError("no readable episode to compute normalisation statistics from")
    stats = {action_key: compute_feature_stats(np.concatenate([e.action for e in episodes]))}
    if all(e.state is not None for e in episodes):
        stats[state_key] = compute_feature_stats(np.concatenate([e.state for e in episodes]))
    return stats


def build_stats(dcfg: DictConfig, episodes: Sequence[Episode]) -> NormStats:
    relative, horizon = list(dcfg.relative_action_dims or []), dcfg.relative_action_horizon
    if dcfg.normalization == "none":
        return NormStats({}, mode="none", action_key=dcfg.action_key, state_key=dcfg.state_key,
                         relative_dims=relative, relative_horizon=horizon)
    if dcfg.stats_path is not None:
        if not os.path.isfile(dcfg.stats_path):
            raise DataError(f"dataset.stats_path {dcfg.stats_path} does not exist; write it with "
                            "`python -m data.compute_stats <dataset_dir> --out <file.json>` or set it to null")
        try:
            stats = NormStats.load(dcfg.stats_path, dcfg.normalization, dcfg.action_key, dcfg.state_key, relative,
                                   horizon)
        except (ValueError, KeyError) as e:
            raise DataError(f"dataset.stats_path {dcfg.stats_path}: {e}") from None
    else:
        stats = NormStats(stats_from_episodes(episodes, dcfg.action_key, dcfg.state_key), dcfg.normalization,
                          dcfg.action_key, dcfg.state_key, relative, horizon)
    if any(e.state is not None for e in episodes) and dcfg.state_key not in stats.stats:
        raise DataError(f"the normalisation statistics have no '{dcfg.state_key}' entry but the data has a state; "
                        f"statistics have {sorted(stats.stats)}")
    return stats


def split(episodes: Sequence[Episode], dcfg: DictConfig) -> tuple[list[Episode], list[Episode]]:
    """(train episodes, val episodes): held-out episodes per folder, never in training."""
    train, val = [], []
    for source in sorted({e.source for e in episodes}):
        mine = [e for e in episodes if e.source == source]
        held = set(split_episodes([e.index for e in mine], dcfg.val_episodes, dcfg.val_fraction)[1])
        train += [e for e in mine if e.index not in held]
        val += [e for e in mine if e.index in held]
    return train, val


def build_datasets(cfg: DictConfig) -> tuple[WindowSource[Any], WindowSource[Any] | None, NormStats]:
    """(train_set, val_set or None, stats). Raises DataError with a clear message on bad paths/data."""
    dcfg = cfg.dataset
    if dcfg.type == "synthetic":
        from data.synthetic import ensure_synthetic
        ensure_synthetic(cfg)
    bad = BadEpisodes(dcfg.skip_bad_samples)
    episodes, image_keys, weights = load_episodes(dcfg, bad, with_video=dcfg.cache_dir is None)
    if not episodes:
        raise DataError(f"no readable episode in {dataset_dirs(dcfg)}")
    check_dims(episodes, cfg)
    stats = build_stats(dcfg, episodes)
    train, val = split(episodes, dcfg)
    if not train:
        raise DataError("every episode is held out for validation; lower dataset.val_fraction "
                        "or shorten dataset.val_episodes")
    train_set: "EpisodeDataset | CachedDataset"
    val_set: "EpisodeDataset | CachedDataset | None"
    if dcfg.cache_dir is not None:
        from data.cache import CachedDataset
        cached = lambda eps: CachedDataset(dcfg.cache_dir, cfg, stats, episodes,  # noqa: E731
                                           {(e.source, e.index) for e in eps}, weights)
        train_set, val_set = cached(train), (cached(val) if val else None)
    else:
        spec, c = WindowSpec.from_config(cfg), cfg.common
        make = lambda eps: EpisodeDataset(eps, spec, image_keys, c.video_height, c.video_width, stats,  # noqa: E731
                                          dcfg.instruction, weights, dcfg.frame_layout)
        train_set, val_set = make(train), (make(val) if val else None)
        short = len(train_set.too_short) + (len(val_set.too_short) if val_set else 0)
        if short:
            logger.warning("%d episodes are shorter than one window (%d frames) and are not used",
                           short, spec.span + 1)
        if len(train_set) == 0:
            raise DataError(f"no training episode has the {spec.span + 1} frames one window needs")
    train_set.bad_episodes = bad.messages
    logger.info("data: %d train / %d val episodes, %d train windows, %d bad episodes skipped",
                len(train), len(val), len(train_set), len(bad.messages))
    return train_set, val_set, stats


def build_train_stream(train_set: WindowSource[Any], cfg: DictConfig, rank: int = 0, world_size: int = 1) -> TrainStream:
    return TrainStream(train_set, cfg.training.seed, cfg.training.batch_size, rank, world_size,
                       cfg.system.num_workers, cfg.system.pin_memory, cfg.dataset.skip_bad_samples)


def build_val_loader(val_set: WindowSource[Any] | None, cfg: DictConfig, rank: int = 0, world_size: int = 1) -> ValLoader | None:
    """Finite and sharded; None when there is no validation set."""
    if val_set is None:
        return None
    return ValLoader(val_set, cfg.training.batch_size, rank, world_size, cfg.system.num_workers,
                     cfg.dataset.skip_bad_samples)
