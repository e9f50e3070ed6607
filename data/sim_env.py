"""Simulated tasks for scripted demonstrations and closed-loop evaluation: LeRobot's gym-aloha
(MuJoCo through dm_control; bimanual ViperX, 14-D joint positions) and gym-pusht (pymunk, 2-D).

`TASKS` is the one table of what each task is: its gym id, the packages it needs, its camera and
state keys (the LeRobot feature names the demonstrations are written under and the policy server
is asked for), its dimensions, its step cap and success rule, and its instruction.

`make_env(name, image_size)` gives a `SimEnv` that seeds exactly as `gym.make(task.gym_id)` does
(the same seed puts the cube in the same place) but renders only when asked: on a CPU a rendered
camera frame costs ~90 ms whatever its size while a physics step costs ~1 ms, and gym-aloha's own
env renders three 480x640 cameras after every step. A policy that executes a chunk of K actions
needs one picture per K steps.

Seeds: demonstrations are drawn from `DEMO_SEEDS`, evaluation from `EVAL_SEEDS`; the two ranges
never meet, so an evaluation never replays a training scene.
"""
import collections
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Tuple

import numpy as np

# Headless rendering: MuJoCo's EGL backend works without a display (osmesa and glfw do not, here);
# set before dm_control is first imported. A user's own MUJOCO_GL wins.
os.environ.setdefault("MUJOCO_GL", "egl")

DEMO_SEEDS = range(0, 1_000_000)
EVAL_SEEDS = range(1_000_000, 2_000_000)


class SimTaskError(ValueError):
    """An unknown task, a missing simulator package or a seed from the wrong range: the message says
    what to do."""


@dataclass(frozen=True)
class SimTask:
    name: str
    gym_id: str
    module: str                  # the import that registers gym_id
    pip: str                     # what to install when `module` is missing
    image_key: str               # LeRobot feature name of the camera
    camera: Optional[str]        # MuJoCo camera rendered into image_key (None: the env's own render)
    state_key: str
    state_dim: int
    action_dim: int
    max_steps: int               # the gym registration's max_episode_steps
    fps: int
    instruction: str
    success: str                 # how the env decides success, for reports


TASKS: Dict[str, SimTask] = {
    "transfer_cube": SimTask(
        name="transfer_cube", gym_id="gym_aloha/AlohaTransferCube-v0", module="gym_aloha",
        pip="gym-aloha==0.1.5", image_key="observation.images.top", camera="top",
        state_key="observation.state", state_dim=14, action_dim=14, max_steps=300, fps=50,
        instruction="Pick up the cube with the right arm and transfer it to the left arm.",
        success="reward 4: the left gripper holds the cube off the table"),
    "insertion": SimTask(
        name="insertion", gym_id="gym_aloha/AlohaInsertion-v0", module="gym_aloha",
        pip="gym-aloha==0.1.5", image_key="observation.images.top", camera="top",
        state_key="observation.state", state_dim=14, action_dim=14, max_steps=300, fps=50,
        instruction="Insert the peg into the socket.",
        success="reward 4: the peg is in the socket"),
    "pusht": SimTask(
        name="pusht", gym_id="gym_pusht/PushT-v0", module="gym_pusht",
        pip="gym-pusht==0.1.8", image_key="observation.image", camera=None,
        state_key="observation.state", state_dim=2, action_dim=2, max_steps=300, fps=10,
        instruction="Push the T-shaped block onto the T-shaped target.",
        success="coverage of the target > 0.95"),
}


def get_task(name: str) -> SimTask:
    """The task called `name`, with its simulator importable; else SimTaskError saying what to do."""
    task = _known(name)
    try:
        importlib.import_module(task.module)
    except ImportError as e:
        raise _missing(task, str(e)) from e
    return task


def installed_task(name: str) -> SimTask:
    """The task called `name` if its simulator package is installed, found without importing it (gym and
    MuJoCo take seconds: a recipe that names a task is checked with this); else SimTaskError."""
    task = _known(name)
    if importlib.util.find_spec(task.module) is None:
        raise _missing(task, f"no module named {task.module!r}")
    return task


def _known(name: str) -> SimTask:
    if name not in TASKS:
        raise SimTaskError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def _missing(task: SimTask, reason: str) -> SimTaskError:
    return SimTaskError(f"task {task.name!r} needs the package {task.pip} ({reason}); install it with "
                        f"`pip install {task.pip}` (scripts/setup.sh installs requirements.txt)")


def check_seeds(seeds: Iterable[int], allowed: range, what: str) -> None:
    """Refuse seeds outside `allowed` (evaluation seeds are never demonstration seeds)."""
    bad = [s for s in seeds if s not in allowed]
    if bad:
        raise SimTaskError(f"{what} seeds must lie in [{allowed.start}, {allowed.stop}); got {bad[:5]}"
                           f"{' ...' if len(bad) > 5 else ''}")


class SimEnv:
    """reset(seed) -> observation; step(action) -> (reward, success); observe() renders the camera.

    An observation is {task.image_key: uint8 [H, W, 3], task.state_key: float32 [state_dim]}."""

    task: SimTask
    image_size: Tuple[int, int]

    def reset(self, seed: int, observe: bool = True) -> Optional[dict]:
        """Start the scene of `seed`; its observation, or None with observe=False (nothing rendered)."""
        raise NotImplementedError

    def step(self, action: np.ndarray) -> Tuple[float, bool]:
        raise NotImplementedError

    def state(self) -> np.ndarray:
        raise NotImplementedError

    def render(self) -> np.ndarray:
        raise NotImplementedError

    def observe(self) -> dict:
        return {self.task.image_key: self.render(), self.task.state_key: self.state()}

    def close(self) -> None:
        pass


class AlohaEnv(SimEnv):
    """gym-aloha's joint-position task on dm_control, without the per-step rendering.

    Seeding, reset pose, physics step and reward are gym-aloha's own (its task classes, its
    `sample_box_pose` / `sample_insertion_pose` of the seed, its control timestep): only
    `get_observation` is replaced by one that renders nothing."""

    def __init__(self, task: SimTask, image_size: Tuple[int, int]) -> None:
        from dm_control import mujoco
        from dm_control.rl import control
        from gym_aloha.constants import ASSETS_DIR, DT
        from gym_aloha.tasks import sim

        self.task, self.image_size, self._sim = task, (int(image_size[0]), int(image_size[1])), sim
        base = {"transfer_cube": sim.TransferCubeTask, "insertion": sim.InsertionTask}[task.name]
        xml = {"transfer_cube": "bimanual_viperx_transfer_cube.xml", "insertion": "bimanual_viperx_insertion.xml"}
        physics = mujoco.Physics.from_xml_path(str(ASSETS_DIR / xml[task.name]))
        self._task = type(f"Unrendered{base.__name__}", (base,), {"get_observation": _unrendered_observation})()
        self._env = control.Environment(physics, self._task, float("inf"), control_timestep=DT,
                                        n_sub_steps=None, flat_observation=False)

    @property
    def physics(self) -> Any:  # dm_control's mujoco.Physics (untyped)
        return self._env.physics

    def reset(self, seed: int, observe: bool = True) -> Optional[dict]:
        from gym_aloha import utils

        # as gym_aloha.env.AlohaEnv.reset: the scene is a function of the seed alone
        self._task.random.seed(seed)
        self._task._random = np.random.RandomState(seed)
        if self.task.name == "transfer_cube":
            self._sim.BOX_POSE[0] = utils.sample_box_pose(seed)
        else:
            self._sim.BOX_POSE[0] = np.concatenate(utils.sample_insertion_pose(seed))
        self._env.reset()
        return self.observe() if observe else None

    def step(self, action: np.ndarray) -> Tuple[float, bool]:
        reward = float(self._env.step(np.asarray(action, dtype=np.float64)).reward)
        return reward, reward == self._task.max_reward

    def state(self) -> np.ndarray:
        return self._task.get_qpos(self.physics).astype(np.float32)

    def render(self) -> np.ndarray:
        h, w = self.image_size
        return self.physics.render(height=h, width=w, camera_id=self.task.camera)


def _unrendered_observation(self: Any, physics: Any) -> collections.OrderedDict[str, np.ndarray]:
    # self: a gym-aloha task of the class AlohaEnv builds; physics: dm_control's mujoco.Physics (both untyped)
    return collections.OrderedDict(qpos=self.get_qpos(physics), qvel=self.get_qvel(physics),
                                   env_state=self.get_env_state(physics))


class PushTEnv(SimEnv):
    """gym-pusht's env as registered (pymunk renders cheaply), at the requested picture size."""

    def __init__(self, task: SimTask, image_size: Tuple[int, int]) -> None:
        import gymnasium as gym

        self.task, self.image_size = task, (int(image_size[0]), int(image_size[1]))
        h, w = self.image_size
        self._env = gym.make(task.gym_id, obs_type="pixels_agent_pos", observation_height=h, observation_width=w,
                             disable_env_checker=True).unwrapped
        self._obs: dict = {}

    def reset(self, seed: int, observe: bool = True) -> Optional[dict]:
        self._obs, _ = self._env.reset(seed=seed)
        return self.observe() if observe else None

    def step(self, action: np.ndarray) -> Tuple[float, bool]:
        self._obs, reward, _, _, info = self._env.step(np.asarray(action, dtype=np.float32))
        return float(reward), bool(info["is_success"])

    def state(self) -> np.ndarray:
        return np.asarray(self._obs["agent_pos"], dtype=np.float32)

    def render(self) -> np.ndarray:
        return np.ascontiguousarray(self._obs["pixels"])


def make_env(name: str, image_size: Tuple[int, int]) -> SimEnv:
    """The task's env, rendering its camera at image_size (H, W) when observed."""
    task = get_task(name)
    return PushTEnv(task, image_size) if task.name == "pusht" else AlohaEnv(task, image_size)
