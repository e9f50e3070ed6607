"""The synthetic dataset of the default recipe: coloured squares that move to their goals.

Each episode shows `num_squares` squares on a grey background, and for each a small dot of the
same colour: its goal. The state is the squares' positions, then their goals (x, y per square,
in [0, 1] of the free range), like a goal-conditioned robot's proprioception; the action at
frame t is the displacement that took the squares from frame t-1 to frame t (position[t] =
position[t-1] + action[t], action[0] = 0). A square heads for its goal at a speed drawn per
episode, with a little noise, and gets a new goal when it arrives. So a world model can learn
how actions move pixels, and a policy can read the next actions off the state and the first
frame. Deterministic from the seed; written in LeRobot v3.0 layout (AV1) by our writer. With 2
squares: action_dim = 4, state_dim = 8 (the tiny recipe).

    python -m data.synthetic assets/synthetic [--num-episodes 24 --episode-length 80 --seed 0]
"""
import argparse
import json
import os
import shutil
from typing import Any

import numpy as np
from omegaconf import DictConfig

from data.errors import DataError
from data.lerobot_writer import LeRobotWriter

COLOURS = [(230, 40, 40), (40, 90, 230), (40, 200, 60), (240, 210, 40), (200, 60, 220), (40, 220, 220)]
COLOUR_NAMES = ["red", "blue", "green", "yellow", "magenta", "cyan"]
BACKGROUND = (90, 90, 90)
CAMERA = "observation.images.top"
PARAMS_FILE = "meta/synthetic.json"
MOTION = "goal_v2"  # recorded with the parameters, so a dataset of an older motion law is refused


def square_size(height: int, width: int) -> int:
    return max(4, min(height, width) // 6)


def _pixel(x: float, y: float, extent: int, height: int, width: int) -> tuple[int, int]:
    return int(round(x * (width - extent))), int(round(y * (height - extent)))


def render(positions: np.ndarray, height: int, width: int, goals: np.ndarray | None = None) -> np.ndarray:
    """uint8 [H, W, 3] frame: one square per (x, y) pair of `positions` (in [0, 1]), and a dot at
    each square's goal, drawn first so a square passing over it hides it."""
    size = square_size(height, width)
    dot = max(2, size // 3)
    frame: np.ndarray = np.empty((height, width, 3), np.uint8)
    frame[:] = BACKGROUND
    for k, (x, y) in enumerate([] if goals is None else goals.reshape(-1, 2)):
        # the dot sits where the square's centre will be when it arrives
        left, top = _pixel(x, y, size, height, width)
        left, top = left + (size - dot) // 2, top + (size - dot) // 2
        frame[top:top + dot, left:left + dot] = COLOURS[k % len(COLOURS)]
    for k, (x, y) in enumerate(positions.reshape(-1, 2)):
        left, top = _pixel(x, y, size, height, width)
        frame[top:top + size, left:left + size] = COLOURS[k % len(COLOURS)]
    return frame


def episode_motion(rng: np.random.Generator, length: int, num_squares: int,
                   noise: float = 0.002) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(state [T, 2n], action [T, 2n], goals [T, 2n]) with state[t] = state[t-1] + action[t] in [0, 1]:
    each square moves straight to its goal at its own speed; a reached goal is replaced."""
    dim = 2 * num_squares
    state: np.ndarray = np.empty((length, dim), np.float64)
    action: np.ndarray = np.zeros((length, dim), np.float64)
    goals: np.ndarray = np.empty((length, dim), np.float64)
    state[0] = rng.uniform(0.1, 0.9, dim)
    goal = rng.uniform(0.05, 0.95, dim)
    speed = rng.uniform(0.02, 0.05, num_squares)
    for t in range(length):
        goals[t] = goal
        if t == 0:
            continue
        offset = (goal - state[t - 1]).reshape(-1, 2)
        distance = np.linalg.norm(offset, axis=1, keepdims=True)
        step = offset * np.minimum(1.0, speed[:, None] / np.maximum(distance, 1e-9))
        step = step.reshape(-1) + rng.normal(0, noise, dim)
        state[t] = np.clip(state[t - 1] + step, 0.0, 1.0)
        action[t] = state[t] - state[t - 1]  # exact even when clipped at a wall
        arrived: np.ndarray = np.repeat(np.linalg.norm((goal - state[t]).reshape(-1, 2), axis=1) < 0.02, 2)
        goal = np.where(arrived, rng.uniform(0.05, 0.95, dim), goal)
    return state.astype(np.float32), action.astype(np.float32), goals.astype(np.float32)


def task_of(num_squares: int) -> str:
    names = [COLOUR_NAMES[k % len(COLOUR_NAMES)] for k in range(num_squares)]
    return "move the " + " and the ".join(f"{n} square" for n in names) + " to the dots"


def generate(out_dir: str, num_episodes: int = 24, episode_length: int = 80, fps: int = 30,
             image_height: int = 48, image_width: int = 64, num_squares: int = 2, seed: int = 0,
             codec: str = "libsvtav1", version: str = "v3.0", episodes_per_file: int = 1000) -> dict[str, Any]:
    """Write the dataset to `out_dir` (LeRobot `version`, v3.0 or v2.1); returns its parameters."""
    rng = np.random.default_rng(seed)
    names = [f"{axis}{k}" for k in range(num_squares) for axis in ("x", "y")]
    features = {
        "observation.state": {"dtype": "float32", "shape": [4 * num_squares],
                              "names": names + [f"goal_{n}" for n in names]},
        "action": {"dtype": "float32", "shape": [2 * num_squares], "names": [f"d{n}" for n in names]},
        CAMERA: {"dtype": "video", "shape": [image_height, image_width, 3],
                 "names": ["height", "width", "channels"]},
    }
    writer = LeRobotWriter(out_dir, fps, features, version=version, robot_type="synthetic_squares", codec=codec,
                           episodes_per_file=episodes_per_file)
    for _ in range(num_episodes):
        state, action, goals = episode_motion(rng, episode_length, num_squares)
        frames = np.stack([render(s, image_height, image_width, g) for s, g in zip(state, goals)])
        writer.add_episode({"observation.state": np.concatenate([state, goals], axis=1), "action": action,
                            CAMERA: frames}, task_of(num_squares))
    writer.close()
    params = dict(num_episodes=num_episodes, episode_length=episode_length, fps=fps, image_height=image_height,
                  image_width=image_width, num_squares=num_squares, seed=seed, motion=MOTION)
    with open(os.path.join(out_dir, PARAMS_FILE), "w") as f:
        json.dump(params, f, indent=2)
    return params


def _params_from_config(cfg: DictConfig) -> dict[str, Any]:
    s, c = cfg.dataset.synthetic, cfg.common
    if c.state_dim != 2 * c.action_dim or c.action_dim % 2:
        raise DataError(f"the synthetic dataset has action_dim = 2 x squares and state_dim = 2 x action_dim; "
                        f"common.state_dim is {c.state_dim} and common.action_dim is {c.action_dim}")
    return dict(num_episodes=s.num_episodes, episode_length=s.episode_length, fps=s.fps,
                image_height=s.image_height, image_width=s.image_width, num_squares=c.action_dim // 2, seed=s.seed)


def ensure_synthetic(cfg: DictConfig) -> None:
    """Generate the synthetic dataset at dataset.dataset_dir unless it is already there (type synthetic only).

    Safe when every rank calls it at once: each writes a private folder and renames it into
    place; the first rename wins. A folder generated with other parameters is an error.
    """
    if cfg.dataset.type != "synthetic":
        return  # other dataset types bring their own folders
    out = str(cfg.dataset.dataset_dir)
    params = _params_from_config(cfg)
    if not os.path.exists(os.path.join(out, PARAMS_FILE)):
        if os.path.exists(out) and os.listdir(out):
            raise DataError(f"{out} exists but is not a synthetic dataset (no {PARAMS_FILE}); "
                            "point dataset.dataset_dir elsewhere or remove the folder")
        tmp = f"{out.rstrip('/')}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        generate(tmp, **params)
        try:
            if os.path.isdir(out):
                os.rmdir(out)  # an empty folder left by someone else
            os.rename(tmp, out)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another rank was first
    with open(os.path.join(out, PARAMS_FILE)) as f:
        found = json.load(f)
    if found != {**params, "motion": MOTION}:
        raise DataError(f"{out} holds a synthetic dataset generated with {found}, but the config asks for "
                        f"{params}; delete the folder to regenerate it or change dataset.dataset_dir")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num-episodes", type=int, default=24)
    parser.add_argument("--episode-length", type=int, default=80)
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--image-height", type=int, default=48)
    parser.add_argument("--image-width", type=int, default=64)
    parser.add_argument("--num-squares", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--codec", default="libsvtav1", help="PyAV encoder (libsvtav1, libx264, ...)")
    parser.add_argument("--version", default="v3.0", choices=("v3.0", "v2.1"), help="LeRobot layout")
    args = parser.parse_args()
    params = generate(args.out_dir, args.num_episodes, args.episode_length, args.fps, args.image_height,
                      args.image_width, args.num_squares, args.seed, args.codec, args.version)
    print(f"wrote {args.out_dir}: {params}")


if __name__ == "__main__":
    main()
