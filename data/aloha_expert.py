"""A scripted expert for gym-aloha's transfer_cube, as joint-space actions.

How it works (the standard way ALOHA sim demonstrations are made, with our own plan):

1. The plan. From the cube's position, `plan_transfer_cube` lays out key poses of both grippers
   over time (mocap position, orientation and normalised opening, 0 closed .. 1 open): the right
   gripper, pitched down, comes over the cube, descends around it, closes, and lifts it to a
   hand-over point above the table's centre while levelling out; the left gripper, rolled a
   quarter turn so its fingers close vertically (the right fingers hold the cube's y faces, so the
   left ones take its top and bottom), waits beside the hand-over point. When the cube is there,
   `plan_left_grasp` brings the left gripper in to where the cube really is, and closes it.
   `interpolate` turns the key poses into one 16-D command per control step (50 Hz): positions
   and openings linearly, orientations by slerp.
2. The end-effector pass. gym-aloha's end-effector scene (the same robots, each gripper welded to
   a mocap body) executes the commands; nothing is rendered. The cube is placed where the joint
   env puts it for the same seed (`gym_aloha.utils.sample_box_pose(seed)`), so both scenes start
   equal. Each step records the arms' joint positions; the gripper entries are replaced by the
   commanded opening, which is what the joint env's gripper actuators take.
3. The joint trajectory is the 14-D action sequence for `data.sim_env` / `gym.make(gym_id)`.
   `expert_trajectory` replays it there (unrendered) and, when it fails, plans again with another
   grasp depth (TIP_BELOW_TRIES). The plan solves the task by step ~165-225, well inside the
   registered 300-step cap.

gym-aloha's top reward also pays a left gripper that lifts a dropped cube off the table by itself,
and a third of this expert's solved seeds are that: with the right gripper pointing along -x, a
cube 5-10 cm off the arm's line slips out of a grasp that closes on it askew. The expert's style
(`EXPERT_STYLES`) says which grasps it tries, in order, and what counts as solved:
- `default`: the -x grasp at each depth of TIP_BELOW_TRIES; any success counts.
- `handover_only`: the right gripper points at the cube from the arm's waist
  (HANDOVER_TIP_BELOW_TRIES), and only a hand-over counts (`handover_step`: the right gripper holds
  the cube off the table before the left one takes it).
- `prefer_handover`: the -x grasp at the depth that hands over; where none does, the pointed grasp;
  where that fails too, the default's (the left gripper alone). The -x approach stays wherever it
  can hand over, and the pointed grasp is used only where it cannot.
"""
import collections
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from data.sim_env import SimEnv, SimTaskError, get_task, make_env

EXPERT_TASKS = ("transfer_cube",)


@dataclass(frozen=True)
class KeyPose:
    step: int              # control step at which the gripper is at this pose
    pos: Tuple[float, float, float]
    quat: Tuple[float, float, float, float]   # MuJoCo order: w, x, y, z (a rotation of the start pose)
    grip: float            # normalised opening: 0 closed, 1 open


# ---- quaternions (w, x, y, z) -------------------------------------------------------------------
def axis_angle(axis: npt.ArrayLike, degrees: float) -> np.ndarray:
    axis = np.asarray(axis, dtype=np.float64)
    half = np.deg2rad(degrees) / 2
    return np.concatenate([[np.cos(half)], np.sin(half) * axis / np.linalg.norm(axis)])


def quat_mul(a: npt.ArrayLike, b: npt.ArrayLike) -> np.ndarray:
    w1, x1, y1, z1 = a
    w2, x2, y2, z2 = b
    return np.array([w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2, w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
                     w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2, w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2])


def slerp(a: npt.ArrayLike, b: npt.ArrayLike, t: float) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    dot = float(a @ b)
    if dot < 0:  # the shorter way round
        b, dot = -b, -dot
    if dot > 0.9995:
        q = a + t * (b - a)
    else:
        theta = np.arccos(dot)
        q = (np.sin((1 - t) * theta) * a + np.sin(t * theta) * b) / np.sin(theta)
    return q / np.linalg.norm(q)


def rotate(q: np.ndarray, v: npt.ArrayLike) -> np.ndarray:
    """The vector v rotated by the unit quaternion q."""
    return quat_mul(quat_mul(q, np.concatenate([[0.0], v])), q * np.array([1, -1, -1, -1]))[1:]


# ---- the plan ------------------------------------------------------------------------------------
# Start poses of the grippers' mocap bodies (gym-aloha's end-effector scene puts them there).
LEFT_START = (-0.31718881, 0.5, 0.29525084)
RIGHT_START = (0.31718881, 0.49999888, 0.29525084)
IDENTITY = (1.0, 0.0, 0.0, 0.0)
# The weld holds each gripper's mocap point 13.5 cm ahead of its gripper link, at the fingertips:
# a mocap position is where the fingertips go.
CUBE_HALF = 0.02            # the cube's half-size (bimanual_viperx_*transfer_cube.xml)
TIP_BELOW = 0.022           # the right fingertips close this far below the cube's centre
# Grasps are chaotic (a few tenths of a millimetre decide whether the cube slips out on the way up,
# and the joint env's soft wrist actuators track the end-effector pass only to a few millimetres),
# so the expert checks its trajectory in the joint env and, when it fails there, tries the next
# grasp depth. Measured on seeds 0-79: 0.022 alone solves 94%; the three tries solve 79 of 80, 54
# of them by a hand-over.
TIP_BELOW_TRIES = (TIP_BELOW, 0.018, 0.026)
# The gripper pointed at the cube, hand-overs counted: on seeds 0-79 0.026 alone hands the cube
# over on 69, 0.022 on 68, the three tries on 70.
HANDOVER_TIP_BELOW_TRIES = (0.026, 0.022, 0.018)
RIGHT_SHOULDER_XY = (0.469, 0.5)   # the right arm's waist joint
RIGHT_PITCH = 70.0          # degrees the right gripper points down when it picks the cube
HANDOVER_PITCH = 15.0       # and at the hand-over, nearly level
HANDOVER = np.array([0.0, 0.5, 0.24])   # where the right fingertips hold the cube for the hand-over
# The left gripper is rolled a quarter turn about the direction it points (+x), so its fingers close
# along z; it waits LEFT_BACK from the hand-over point, then its upper finger pad goes to LEFT_DEPTH
# short of the held cube's centre (in x) and LEFT_RISE above it.
LEFT_Q = tuple(axis_angle([1, 0, 0], 90.0))
LEFT_BACK = np.array([-0.1, 0.0, 0.0])
LEFT_DEPTH = 0.015
LEFT_RISE = 0.01
# Control steps of the plan's phases (50 Hz). The welds lag their mocap bodies by a few steps, so
# each move is followed by a short hold before the gripper acts. The left finger touches the held
# cube (reward 4) around LEFT_IN.
APPROACH, DESCEND, CLOSE_FROM, CLOSE, LIFT = 55, 85, 92, 105, 145
LEFT_WAIT, LEFT_IN, LEFT_CLOSE, RELEASE, END = 145, 170, 185, 200, 230


def plan_transfer_cube(cube_xyz: npt.ArrayLike, tip_below: float = TIP_BELOW,
                       point_at_cube: bool = False) -> Tuple[List[KeyPose], List[KeyPose]]:
    """Key poses (left, right) handing the cube at cube_xyz from the right gripper to the left one.
    The right gripper picks with its fingertips down, pointing along -x (as at rest) or, with
    `point_at_cube`, turned about z to point at the cube from the arm's waist."""
    # gym-aloha drops the cube from 5 cm: it lies on the table, its centre one half-size up
    cube = np.array([cube_xyz[0], cube_xyz[1], CUBE_HALF])
    reach = cube[:2] - np.asarray(RIGHT_SHOULDER_XY)
    yaw = np.degrees(np.arctan2(-reach[1], -reach[0])) if point_at_cube else 0.0
    pick_q = tuple(quat_mul(axis_angle([0, 0, 1], yaw), axis_angle([0, 1, 0], -RIGHT_PITCH)))
    level_q = tuple(axis_angle([0, 1, 0], -HANDOVER_PITCH))
    grasp = cube - [0, 0, tip_below]
    above = grasp + [0, 0, 0.08]                            # then straight down, fingers either side of the cube
    right = [KeyPose(0, RIGHT_START, IDENTITY, 0.0),
             KeyPose(APPROACH, tuple(above), pick_q, 1.0),
             KeyPose(DESCEND, tuple(grasp), pick_q, 1.0),
             KeyPose(CLOSE_FROM, tuple(grasp), pick_q, 1.0),
             KeyPose(CLOSE, tuple(grasp), pick_q, 0.0),
             KeyPose(LIFT, tuple(HANDOVER), level_q, 0.0),
             KeyPose(RELEASE, tuple(HANDOVER), level_q, 0.0),
             KeyPose(END, tuple(HANDOVER + [0.05, 0, 0]), level_q, 1.0)]
    left = [KeyPose(0, LEFT_START, IDENTITY, 0.0),
            KeyPose(LEFT_WAIT, tuple(HANDOVER + LEFT_BACK), LEFT_Q, 1.0)]
    return left, right


def plan_left_grasp(held_cube_xyz: npt.ArrayLike, finger_offset: npt.ArrayLike) -> List[KeyPose]:
    """The left gripper's key poses from LEFT_WAIT on: its upper finger (the one gym-aloha's reward
    looks at) comes in level with the held cube, then the gripper closes on it. Where the cube sits
    between the right fingers varies by a few cm, and the open fingers sag under gravity, so this is
    planned at LEFT_WAIT from where both are (`finger_offset`: upper finger pad minus mocap point)."""
    finger = np.asarray(held_cube_xyz, dtype=np.float64) + [-LEFT_DEPTH, 0, LEFT_RISE]
    grasp = finger - np.asarray(finger_offset)
    return [KeyPose(LEFT_WAIT, tuple(HANDOVER + LEFT_BACK), LEFT_Q, 1.0),
            KeyPose(LEFT_IN, tuple(grasp), LEFT_Q, 1.0),
            KeyPose(LEFT_CLOSE, tuple(grasp), LEFT_Q, 0.0),
            KeyPose(END, tuple(grasp + [-0.05, 0, 0]), LEFT_Q, 0.0)]


def interpolate(keys: List[KeyPose]) -> np.ndarray:
    """float64 [keys[-1].step + 1, 8]: (pos, quat, grip) per control step between the key poses."""
    out = np.zeros((keys[-1].step + 1, 8))
    for a, b in zip(keys[:-1], keys[1:]):
        for t in range(a.step, b.step + 1):
            u = (t - a.step) / (b.step - a.step)
            out[t, :3] = (1 - u) * np.asarray(a.pos) + u * np.asarray(b.pos)
            out[t, 3:7] = slerp(a.quat, b.quat, u)
            out[t, 7] = (1 - u) * a.grip + u * b.grip
    return out


# ---- the end-effector pass -----------------------------------------------------------------------
class EndEffectorScene:
    """gym-aloha's end-effector transfer_cube scene, the cube placed by the seed, rendering nothing."""

    def __init__(self) -> None:
        from dm_control import mujoco
        from dm_control.rl import control
        from gym_aloha.constants import ASSETS_DIR, DT
        from gym_aloha.tasks.sim_end_effector import TransferCubeEndEffectorTask

        physics = mujoco.Physics.from_xml_path(str(ASSETS_DIR / "bimanual_viperx_end_effector_transfer_cube.xml"))
        self.task = _SeededEndEffectorTask(TransferCubeEndEffectorTask)()
        self.env = control.Environment(physics, self.task, float("inf"), control_timestep=DT,
                                       n_sub_steps=None, flat_observation=False)

    def reset(self, seed: int) -> np.ndarray:
        """Start the scene of `seed`; returns the cube's position."""
        from gym_aloha.utils import sample_box_pose

        self.task.box_pose = sample_box_pose(seed)  # as the joint env places it (gym_aloha.env.AlohaEnv.reset)
        self.env.reset()
        return self.cube()

    def cube(self) -> np.ndarray:
        return self.env.physics.named.data.qpos["red_box_joint"][:3].copy()

    def left_finger_offset(self) -> np.ndarray:
        """The left gripper's upper finger pad (gym-aloha's reward checks its contact) minus its mocap point."""
        physics = self.env.physics
        return physics.named.data.geom_xpos["vx300s_left/10_left_gripper_finger"] - physics.data.mocap_pos[0]

    def step(self, command: np.ndarray) -> Tuple[np.ndarray, float]:
        """Execute one 16-D command; the arms' joint positions after it (gym-aloha's 14-D qpos) and reward."""
        reward = float(self.env.step(command).reward)
        return self.task.get_qpos(self.env.physics), reward


def _SeededEndEffectorTask(base: type[Any]) -> type[Any]:
    """`base` with the cube placed at `self.box_pose` (gym-aloha draws it unseeded) and an
    observation that renders nothing (the end-effector task renders three 480x640 cameras)."""

    # self: an instance of the class built below; physics: dm_control's mujoco.Physics (both untyped)
    def initialize_episode(self: Any, physics: Any) -> None:
        self.initialize_robots(physics)
        start = physics.model.name2id("red_box_joint", "joint")
        np.copyto(physics.data.qpos[start:start + 7], self.box_pose)
        super(base, self).initialize_episode(physics)

    def get_observation(self: Any, physics: Any) -> collections.OrderedDict[str, np.ndarray]:
        return collections.OrderedDict(qpos=self.get_qpos(physics))

    return type(f"Seeded{base.__name__}", (base,), {"initialize_episode": initialize_episode,
                                                    "get_observation": get_observation, "box_pose": None})


_SCENE: List["EndEffectorScene"] = []  # one scene per process: building the physics costs more than an episode's plan
_JOINT_ENV: List[SimEnv] = []          # and one joint-space env (never rendered) to check the trajectory in


def end_effector_pass(seed: int, tip_below: float = TIP_BELOW, point_at_cube: bool = False) -> Tuple[np.ndarray, int]:
    """(joint actions float32 [T, 14], first step at which the end-effector scene had reward 4, or -1)."""
    if not _SCENE:
        _SCENE.append(EndEffectorScene())
    scene = _SCENE[0]
    cube = scene.reset(seed)
    left, right = plan_transfer_cube(cube, tip_below, point_at_cube)
    commands = np.zeros((END + 1, 16))
    commands[:LEFT_WAIT + 1, :8], commands[:, 8:] = interpolate(left), interpolate(right)
    actions, solved = [], -1
    for t, command in enumerate(commands):
        if t == LEFT_WAIT:  # the cube is at the hand-over point: plan the left gripper's grasp
            left_grasp = plan_left_grasp(scene.cube(), scene.left_finger_offset())
            commands[LEFT_WAIT:, :8] = interpolate(left_grasp)[LEFT_WAIT:]
        qpos, reward = scene.step(command)
        qpos[6], qpos[13] = command[7], command[15]  # the commanded opening, as the joint env takes it
        actions.append(qpos)
        if reward == 4 and solved < 0:
            solved = t
    return np.asarray(actions, dtype=np.float32), solved


# Each style's grasps, tried in order until one solves: (point the right gripper at the cube, grasp
# depths, only a hand-over counts). On seeds 0-79 prefer_handover hands the cube over on 76 (61 with
# the -x grasp, 15 pointed) and leaves 4 to the left gripper alone; the default hands over on 54.
_ATTEMPTS = {
    "default": ((False, TIP_BELOW_TRIES, False),),
    "handover_only": ((True, HANDOVER_TIP_BELOW_TRIES, True),),
    "prefer_handover": ((False, TIP_BELOW_TRIES, True), (True, HANDOVER_TIP_BELOW_TRIES, True),
                        (False, TIP_BELOW_TRIES, False)),
}
EXPERT_STYLES = tuple(_ATTEMPTS)
"""The expert's styles (module docstring)."""
HANDOVER_ONLY_STYLES = tuple(style for style, attempts in _ATTEMPTS.items() if all(h for _, _, h in attempts))
"""The styles whose every success is a hand-over (the others also accept the left gripper alone)."""


def expert_trajectory(task_name: str, seed: int, style: str = "default") -> np.ndarray:
    """float32 [T, 14]: the scripted expert's joint-space actions for the scene of `seed` (no rendering),
    in one of EXPERT_STYLES."""
    return expert_replayed(task_name, seed, style)[0]


def expert_replayed(task_name: str, seed: int, style: str = "default") -> Tuple[np.ndarray, List[float]]:
    """`expert_trajectory`'s actions and their rewards in the joint-space scene of `seed` up to the first
    SOLVED one (`rewards_of`): the try it kept, or the last try's when none solves."""
    task = get_task(task_name)
    if task.name not in EXPERT_TASKS:
        raise SimTaskError(f"no scripted expert for task {task_name!r}; experts exist for: {', '.join(EXPERT_TASKS)}")
    if style not in _ATTEMPTS:
        raise SimTaskError(f"expert style {style!r}; expected one of {', '.join(EXPERT_STYLES)}")
    if not _JOINT_ENV:
        _JOINT_ENV.append(make_env(task.name, (16, 16)))
    for point_at_cube, depths, handover in _ATTEMPTS[style]:
        for tip_below in depths:
            actions = end_effector_pass(seed, tip_below, point_at_cube)[0]
            rewards = rewards_of(_JOINT_ENV[0], seed, actions)
            if solved_step(rewards, handover) >= 0:
                return actions, rewards
    return actions, rewards  # the last try's when none solves


# gym-aloha's transfer_cube rewards: 2, the right gripper touches the cube and the table does not;
# 4 (the task solved), the left gripper touches it and neither the table nor the right gripper does
HELD, SOLVED = 2.0, 4.0


def held_before_solved(rewards: Sequence[float]) -> bool:
    """The right gripper held the cube off the table (reward 2) at a step before any SOLVED one."""
    for reward in rewards:
        if reward == SOLVED:
            return False
        if reward == HELD:
            return True
    return False


def solved_step(rewards: Sequence[float], handover_only: bool) -> int:
    """The first step of `rewards` (one per step) with the task's top reward, SOLVED, or -1; with
    `handover_only`, -1 too unless the right gripper held the cube off the table before it."""
    if SOLVED not in rewards or (handover_only and not held_before_solved(rewards)):
        return -1
    return list(rewards).index(SOLVED)


def handover_step(rewards: Sequence[float]) -> int:
    """The step solving the task by a hand-over, or -1. The top reward alone also pays a left gripper
    that lifts the cube off the table itself, which is no hand-over."""
    return solved_step(rewards, handover_only=True)


def rewards_of(env: SimEnv, seed: int, actions: np.ndarray) -> List[float]:
    """The reward of each step of `actions` from the joint-space scene of `seed`, up to the first
    SOLVED one (no rendering)."""
    env.reset(seed, observe=False)
    rewards: List[float] = []
    for action in actions:
        rewards.append(env.step(action)[0])
        if rewards[-1] == SOLVED:
            break
    return rewards
