"""The Motus preprocessed RoboTwin 2.0 layout (dataset.type robotwin).

    <dataset_dir>/
      clean/<task>/qpos/<episode>.pt      torch tensor [T, 14]: joint positions (arms + grippers)
      clean/<task>/videos/<episode>.mp4   the three cameras already combined into one frame
      clean/<task>/metas/<episode>.txt    instructions, one per line
      clean/<task>/umt5_wan/<episode>.pt  (Motus's pre-encoded text; not needed here)
      randomized/<task>/...               the same for the domain-randomised demonstrations

As in Motus, the state is qpos at the condition frame and the actions are qpos at the action
frames (absolute joint targets). `dataset.data_mode` picks clean, randomized or both;
`dataset.task_mode` single (only `dataset.task_name`) or multi (every task, each task
weighted equally). An episode's instruction varies with the condition frame over the lines of
its metas file, deterministically.
"""
import os
from collections.abc import Callable

import av
import numpy as np
import torch

from data.episodes import Episode
from data.errors import DataError

CAMERA = "video"
"""The one camera key of this layout: the mp4 already holds Motus's three-camera picture (its converter
composes it as data/robotwin_frame.compose_cameras does); dataset.frame_layout robotwin fits it to the
frame size as Motus does."""


def _episode_names(task_dir: str) -> list[str]:
    names = [f[:-3] for f in os.listdir(os.path.join(task_dir, "qpos")) if f.endswith(".pt")]
    return sorted(names, key=lambda n: (0, int(n), "") if n.isdigit() else (1, 0, n))


def task_dirs(root: str, data_mode: str, task_mode: str, task_name: str | None) -> dict[str, list[str]]:
    """{task: [task folders]} selected by data_mode and task_mode."""
    if not os.path.isdir(root):
        raise DataError(f"robotwin dataset_dir {root} does not exist")
    splits = ["clean", "randomized"] if data_mode == "both" else [data_mode]
    if task_mode == "single" and not task_name:
        raise DataError("dataset.task_mode is single but dataset.task_name is not set")
    tasks: dict[str, list[str]] = {}
    for split in splits:
        split_dir = os.path.join(root, split)
        if not os.path.isdir(split_dir):
            continue
        for task in sorted(os.listdir(split_dir)):
            folder = os.path.join(split_dir, task)
            if os.path.isdir(os.path.join(folder, "qpos")) and (task_mode == "multi" or task == task_name):
                tasks.setdefault(task, []).append(folder)
    if not tasks:
        wanted = f"task '{task_name}'" if task_mode == "single" else "any task"
        raise DataError(f"{root}: no {wanted} with a qpos/ folder under {' or '.join(splits)}/")
    return tasks


def _load_qpos(path: str) -> np.ndarray:
    try:
        qpos = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"qpos file {path} does not exist") from None
    except Exception as e:  # torch raises several types for a truncated or foreign file
        raise DataError(f"qpos file {path} cannot be read: {e}") from None
    qpos = np.asarray(qpos.float().numpy() if isinstance(qpos, torch.Tensor) else qpos, dtype=np.float32)
    if qpos.ndim != 2:
        raise DataError(f"qpos file {path}: expected a [T, dim] tensor, got shape {qpos.shape}")
    return qpos


def _video_fps_frames(path: str) -> tuple[float, int]:
    if not os.path.isfile(path):
        raise DataError(f"video file {path} does not exist")
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            return float(stream.average_rate or stream.base_rate), int(stream.frames)
    except (av.error.FFmpegError, IndexError) as e:
        raise DataError(f"video file {path} cannot be opened: {e}") from None


def _instructions(path: str) -> list[str]:
    if not os.path.isfile(path):
        return [""]
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines or [""]


def load_robotwin(root: str, data_mode: str, task_mode: str, task_name: str | None, max_episodes: int | None,
                  on_bad: Callable[[str], None]) -> tuple[list[Episode], list[str]]:
    """(episodes, task names): one source per task, episodes numbered within their task."""
    tasks = task_dirs(root, data_mode, task_mode, task_name)
    episodes = []
    for source, (task, folders) in enumerate(sorted(tasks.items())):
        position = 0
        for folder in folders:
            names = _episode_names(folder)
            for name in names[:max_episodes] if max_episodes else names:
                qpos_path = os.path.join(folder, "qpos", name + ".pt")
                try:
                    qpos = _load_qpos(qpos_path)
                    video = os.path.join(folder, "videos", name + ".mp4")
                    fps, frames = _video_fps_frames(video)
                    bad = ~np.isfinite(qpos)
                    if bad.any():
                        raise DataError(f"qpos file {qpos_path}: {int(bad.sum())} NaN/inf values")
                except DataError as e:
                    on_bad(f"episode {name} of task {task}: {e}")
                    continue
                length = min(len(qpos), frames) if frames > 0 else len(qpos)
                lines = _instructions(os.path.join(folder, "metas", name + ".txt"))
                episodes.append(Episode(
                    source=source, index=position, length=length, action=qpos[:length], state=qpos[:length],
                    timestamps=np.arange(length) / fps, task_ids=np.arange(length) % len(lines), tasks=lines,
                    videos={CAMERA: (video, 0.0)}, fps=fps, origin=qpos_path))
                position += 1
    return episodes, sorted(tasks)
