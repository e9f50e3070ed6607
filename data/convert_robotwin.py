"""Convert RoboTwin 2.0 HDF5 episodes into a LeRobot v3.0 dataset.

    python -m data.convert_robotwin <in: folder of episode*.hdf5 (searched recursively) or one file> <out>

Two HDF5 layouts are read:
- classic (RoboTwin's collector): observation/<camera>/rgb (JPEG/PNG bytes per frame, or raw
  uint8 [T, H, W, 3]) and joint_action/vector [T, 14] (left arm 6, left gripper 1, right arm 6,
  right gripper 1; or the four parts joint_action/left_arm, left_gripper, right_arm,
  right_gripper). Instructions come from instructions/<episode>.json ({"seen": [...]}) beside
  the data/ folder when present.
- newer (`data_format_version` v1.0): vision/<camera>/colors (encoded frames),
  state/{left,right}_arm_joint_states + state/{left,right}_ee_joint_states (or
  state/joint_states), the same under action/, additional_info/frequency, instructions (JSON).
  Here state[t] is the trajectory at t and action[t] the trajectory at t + 1.

The classic layout is aligned the same way (state = vector[:-1], action = vector[1:], frames[:-1]),
so both give "action = the next joint target". Cameras become observation.images.cam_high
(head), cam_left_wrist, cam_right_wrist (ALOHA names, in that order: the order
dataset.frame_layout robotwin composes them in) plus any other camera under its own name after them.

RoboTwin writes its JPEG frames with OpenCV from RGB arrays (envs/utils/pkl2hdf5.images_encoding:
"OpenCV intentionally interprets this RGB array as BGR while encoding"), so the bytes decode to the
camera's RGB only in OpenCV's channel order: a standard RGB decoder gives blue and red swapped.
The frames are read back as OpenCV reads them, the RGB RoboTwin's evaluation hands a policy.
"""
import argparse
import glob
import io
import json
import os
import re
from collections.abc import Sequence
from typing import TypedDict

import h5py
import numpy as np
from PIL import Image

from data.errors import DataError
from data.lerobot_writer import LeRobotWriter

CAMERA_NAMES = {"head_camera": "cam_high", "cam_head": "cam_high", "left_camera": "cam_left_wrist",
                "right_camera": "cam_right_wrist", "front_camera": "cam_front"}
PARTS = ("left_arm", "left_gripper", "right_arm", "right_gripper")
NEW_PARTS = ("left_arm_joint_states", "left_ee_joint_states", "right_arm_joint_states", "right_ee_joint_states")


class HDF5Episode(TypedDict):
    """One RoboTwin HDF5 episode, aligned so that action[t] is the joint target after state[t]."""
    state: np.ndarray  # float32 [T, dim]
    action: np.ndarray  # float32 [T, dim]
    cameras: dict[str, np.ndarray]  # ALOHA camera name -> uint8 [T, H, W, 3], head and wrists first
    instruction: str | None
    fps: float | None  # None: the file does not say


def _frames(dataset: h5py.Dataset, path: str, key: str) -> np.ndarray:
    """All frames of a camera dataset as uint8 [T, H, W, 3]."""
    data = dataset[()]
    if data.dtype == np.uint8 and data.ndim == 4:
        return data
    frames = []
    for t, blob in enumerate(data):
        try:
            frames.append(np.asarray(Image.open(io.BytesIO(bytes(blob))).convert("RGB"))[..., ::-1])
        except Exception as e:  # PIL raises several types for undecodable bytes
            raise DataError(f"{path}: frame {t} of {key} cannot be decoded: {e}") from None
    return np.stack(frames)


def _camera_order(name: str) -> tuple[int, str]:
    """head, left wrist, right wrist first (frame_layout robotwin's order), then the rest by name."""
    first = ("cam_high", "cam_left_wrist", "cam_right_wrist")
    return (first.index(name), "") if name in first else (len(first), name)


def _vector(group: h5py.Group, names: Sequence[str], path: str, where: str) -> np.ndarray:
    missing = [n for n in names if n not in group]
    if missing:
        raise DataError(f"{path}: {where} has no {missing}; it has {sorted(group.keys())}")
    parts = [np.asarray(group[n][()], dtype=np.float32) for n in names]
    return np.concatenate([p.reshape(len(p), -1) for p in parts], axis=1)


def _text(value: h5py.Dataset) -> str:
    value = value[()] if hasattr(value, "shape") else value
    return value.decode() if isinstance(value, bytes) else str(value)


def _instruction_file(path: str) -> str | None:
    stem = os.path.splitext(os.path.basename(path))[0]
    candidate = os.path.join(os.path.dirname(os.path.dirname(path)), "instructions", stem + ".json")
    if os.path.isfile(candidate):
        with open(candidate) as f:
            data = json.load(f)
        seen = data.get("seen") if isinstance(data, dict) else data
        if seen:
            return str(seen[0])
    return None


def _task_from_path(path: str) -> str:
    parts = os.path.normpath(path).split(os.sep)
    # <task>/<config>/data/episodeN.hdf5 is RoboTwin's own output tree
    name = parts[-4] if len(parts) >= 4 and parts[-2] == "data" else parts[-2]
    return name.replace("_", " ")


def read_episode(path: str) -> HDF5Episode:
    """{"state", "action", "cameras": {key: frames}, "instruction", "fps" or None} of one HDF5 file."""
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path} is not a readable HDF5 file: {e}") from None
    with f:
        if "vision" in f and "state" in f and "action" in f:
            state_names = NEW_PARTS if all(n in f["state"] for n in NEW_PARTS) else ("joint_states",)
            state = _vector(f["state"], state_names, path, "state/")
            action = _vector(f["action"], state_names, path, "action/")
            cameras = {CAMERA_NAMES.get(k, k): _frames(f["vision"][k]["colors"], path, f"vision/{k}/colors")
                       for k in sorted(f["vision"]) if "colors" in f["vision"][k]}
            instruction = None
            if "instructions" in f:
                listed = json.loads(_text(f["instructions"]))
                instruction = str(listed[0]) if isinstance(listed, list) and listed else str(listed)
            fps = float(f["additional_info"]["frequency"][()]) if "additional_info/frequency" in f else None
        elif "observation" in f and "joint_action" in f:
            ja = f["joint_action"]
            vector = np.asarray(ja["vector"][()], dtype=np.float32) if "vector" in ja else _vector(ja, PARTS, path,
                                                                                                   "joint_action/")
            state, action = vector[:-1], vector[1:]
            cameras = {CAMERA_NAMES.get(k, k): _frames(f["observation"][k]["rgb"], path, f"observation/{k}/rgb")[:-1]
                       for k in sorted(f["observation"]) if "rgb" in f["observation"][k]}
            instruction, fps = _instruction_file(path), None
        else:
            raise DataError(f"{path}: neither RoboTwin layout (observation/ + joint_action/, or vision/ + state/ + "
                            f"action/); top-level groups are {sorted(f.keys())}")
    if not cameras:
        raise DataError(f"{path}: no camera frames found")
    cameras = {k: cameras[k] for k in sorted(cameras, key=_camera_order)}
    for key, frames in cameras.items():
        if len(frames) != len(state):
            raise DataError(f"{path}: camera {key} has {len(frames)} frames, the joint data {len(state)}")
    if not np.isfinite(state).all() or not np.isfinite(action).all():
        raise DataError(f"{path}: joint data has NaN/inf values")
    return {"state": state, "action": action, "cameras": cameras, "instruction": instruction, "fps": fps}


def episode_files(source: str) -> list[str]:
    if os.path.isfile(source):
        return [source]
    files = glob.glob(os.path.join(source, "**", "*.hdf5"), recursive=True)
    number = lambda p: [int(n) if n.isdigit() else n for n in re.split(r"(\d+)", p)]  # noqa: E731
    if not files:
        raise DataError(f"{source}: no .hdf5 files found")
    return sorted(files, key=number)


def convert(source: str, out: str, fps: float | None = None, task: str | None = None, codec: str = "libsvtav1",
            skip_bad: bool = False) -> tuple[int, list[str]]:
    """Write `out` (LeRobot v3.0) from the RoboTwin episodes under `source`; returns the episode count and
    the messages of the episodes skipped."""
    writer, skipped = None, []
    for path in episode_files(source):
        try:
            ep = read_episode(path)
        except DataError as e:
            if not skip_bad:
                raise
            skipped.append(str(e))
            print(f"skipping: {e}")
            continue
        if writer is None:
            dim = ep["state"].shape[1]
            names = [f"{p}_{i}" for p in ("left_arm", "left_gripper", "right_arm", "right_gripper")
                     for i in range({"left_arm": 6, "right_arm": 6}.get(p, 1))] if dim == 14 else None
            features = {"observation.state": {"dtype": "float32", "shape": [dim], "names": names},
                        "action": {"dtype": "float32", "shape": [ep["action"].shape[1]], "names": names}}
            for key, video in ep["cameras"].items():
                features[f"observation.images.{key}"] = {"dtype": "video", "shape": list(video.shape[1:]),
                                                         "names": ["height", "width", "channels"]}
            rate = fps or ep["fps"] or 15
            writer = LeRobotWriter(out, int(round(rate)), features, robot_type="aloha-agilex", codec=codec)
        frames = {"observation.state": ep["state"], "action": ep["action"]}
        frames.update({f"observation.images.{k}": v for k, v in ep["cameras"].items()})
        missing = set(writer.features) - set(frames)
        if missing or ep["state"].shape[1] != writer.features["observation.state"]["shape"][0]:
            message = f"{path}: does not match the first episode (missing {sorted(missing)} or another state width)"
            if not skip_bad:
                raise DataError(message)
            skipped.append(message)
            continue
        writer.add_episode({k: frames[k] for k in writer.features}, task or ep["instruction"] or _task_from_path(path))
    if writer is None:
        raise DataError(f"{source}: no episode could be converted")
    writer.close()
    return len(writer.episodes), skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="folder searched recursively for *.hdf5, or one .hdf5 file")
    parser.add_argument("out", help="new LeRobot v3.0 folder")
    parser.add_argument("--fps", type=float, default=None,
                        help="frame rate; default: additional_info/frequency of the file, else 15")
    parser.add_argument("--task", default=None, help="instruction for every episode (default: from the data)")
    parser.add_argument("--codec", default="libsvtav1")
    parser.add_argument("--skip-bad", action="store_true", help="skip unreadable episodes instead of stopping")
    args = parser.parse_args()
    count, skipped = convert(args.source, args.out, args.fps, args.task, args.codec, args.skip_bad)
    print(f"wrote {count} episodes to {args.out} ({len(skipped)} skipped)")


if __name__ == "__main__":
    main()
