"""Latent-action pretraining data (dataset.type latent_action): a simple documented format.

    <dataset_dir>/
      meta.json                  {"format": "latent_action", "version": 1, "fps": 30}
      episodes/<name>.npz        one file per episode:
        latent_actions  float32 [T, action_dim]  the latent action at each raw frame, in the
                                                 same role as LeRobot's `action` column
        video           str      mp4 path, relative to dataset_dir (or absolute)
        video_start     float    optional: time of the episode's first frame in the mp4 (default 0)
        instruction     str      optional
        state           float32 [T, state_dim]   optional (pretraining usually has none)

Frame k of an episode is the mp4 frame shown at video_start + k / fps. The window, resize and
normalisation are the same as for LeRobot; the statistics key of the latent actions is
dataset.action_key. `write_latent_episode` writes one episode file.
"""
import json
import os
import zipfile
from typing import Any, Callable

import numpy as np

from data.episodes import Episode
from data.errors import DataError

CAMERA = "video"


def read_meta(root: str) -> dict[str, Any]:
    path = os.path.join(root, "meta.json")
    if not os.path.isfile(path):
        raise DataError(f"{root} is not a latent_action dataset: {path} does not exist")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != "latent_action" or "fps" not in meta:
        raise DataError(f"{path}: expected {{\"format\": \"latent_action\", \"version\": 1, \"fps\": ...}}, "
                        f"got {meta}")
    return meta


def write_meta(root: str, fps: float) -> None:
    os.makedirs(os.path.join(root, "episodes"), exist_ok=True)
    with open(os.path.join(root, "meta.json"), "w") as f:
        json.dump({"format": "latent_action", "version": 1, "fps": fps}, f, indent=2)


def write_latent_episode(root: str, name: str, latent_actions: np.ndarray, video: str, instruction: str | None = None,
                         state: np.ndarray | None = None, video_start: float = 0.0) -> None:
    arrays = {"latent_actions": np.asarray(latent_actions, dtype=np.float32), "video": np.array(video),
              "video_start": np.array(float(video_start))}
    if instruction is not None:
        arrays["instruction"] = np.array(instruction)
    if state is not None:
        arrays["state"] = np.asarray(state, dtype=np.float32)
    np.savez(os.path.join(root, "episodes", name + ".npz"), **arrays)


def _read_episode(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise DataError(f"latent-action file {path} does not exist") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"latent-action file {path} cannot be read: {e}") from None
    for key in ("latent_actions", "video"):
        if key not in data:
            raise DataError(f"latent-action file {path} has no '{key}' array; it has {sorted(data)}")
    return data


def load_latent_action(root: str, source: int, max_episodes: int | None, on_bad: Callable[[str], None],
                       numeric_only: bool = False) -> list[Episode]:
    meta = read_meta(root)
    folder = os.path.join(root, "episodes")
    names = sorted(f[:-4] for f in os.listdir(folder) if f.endswith(".npz")) if os.path.isdir(folder) else []
    if not names:
        raise DataError(f"{root}: no episode files under episodes/*.npz")
    fps = float(meta["fps"])
    episodes = []
    for index, name in enumerate(names[:max_episodes] if max_episodes else names):
        path = os.path.join(folder, name + ".npz")
        try:
            data = _read_episode(path)
            actions = np.asarray(data["latent_actions"], dtype=np.float32)
            state = np.asarray(data["state"], dtype=np.float32) if "state" in data else None
            for key, values in (("latent_actions", actions), ("state", state)):
                if values is None:
                    continue
                if values.ndim != 2 or len(values) != len(actions):
                    raise DataError(f"{path}: '{key}' has shape {values.shape}; expected [{len(actions)}, dim]")
                if not np.isfinite(values).all():
                    raise DataError(f"{path}: '{key}' has {int((~np.isfinite(values)).sum())} NaN/inf values")
            video = str(data["video"])
            video = video if os.path.isabs(video) else os.path.join(root, video)
            if not numeric_only and not os.path.isfile(video):
                raise DataError(f"{path}: video file {video} does not exist")
        except DataError as e:
            on_bad(f"episode {index} ({name}): {e}")
            continue
        instruction = str(data["instruction"]) if "instruction" in data else ""
        episodes.append(Episode(
            source=source, index=index, length=len(actions), action=actions, state=state,
            timestamps=np.arange(len(actions)) / fps, task_ids=np.zeros(len(actions), dtype=np.int64),
            tasks=[instruction], videos={CAMERA: (video, float(data.get("video_start", 0.0)))}, fps=fps,
            origin=path))
    return episodes
