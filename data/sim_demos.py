"""Scripted demonstrations in a simulator, written as a LeRobot v3.0 dataset.

    python -m data.sim_demos --task transfer_cube --episodes 50 --out DIR \
        [--seed S] [--image-size H W] [--workers N] [--tail K] [--expert-style STYLE] [--action-noise STD]

Seeds S, S+1, ... (from data.sim_env.DEMO_SEEDS) are given to the scripted expert
(data/aloha_expert.py), whose joint-space actions are replayed in the task's joint-space env
(data.sim_env.make_env, the scene gym.make(gym_id) builds for that seed). Only episodes the replay
solves are kept, until --episodes are; an episode ends --tail steps after the step that solved it.
--expert-style picks how the expert grasps and what it counts as solved (data/aloha_expert.py):
`default`; `handover_only` keeps only the episodes solved by a hand-over (the right gripper holds the
cube off the table before the left one takes it); `prefer_handover` hands over wherever a grasp can.
The expert's own unrendered replay (`expert_replayed`'s rewards) decides whether an episode is kept;
each kept one is replayed once more, rendering the camera before every action: a rendered frame
costs ~90 ms on a CPU, a physics step ~1 ms, so frames are rendered for kept episodes only.
Seeds are spread over --workers processes, each with its own env.

--action-noise STD (radians) records demonstrations that show recoveries, as DART does (Laskey et
al. 2017): the arms' joint targets are executed with a slowly varying offset (an Ornstein-Uhlenbeck
process of that standard deviation, correlated over NOISE_STEPS steps; the grippers are left alone),
while the recorded action stays the expert's own. The states and frames are those of the perturbed
arm, the labels where the plan goes, so a policy learns to come back to the plan from off it. An
open-loop plan is fragile (0.01 rad fails 3 of 30 seeds): up to NOISE_DRAWS offsets are drawn per
seed (from the seed and the draw's index, so a folder is made again exactly) and the first whose
execution solves the task is kept; a seed none solves counts as one the expert failed.

Written under a temporary folder beside --out and renamed to --out at the end: --out never holds a
half-written dataset, and an existing non-empty --out is refused. `meta/sim_demos.json` records the
task, the expert's style and the seed of each episode in episode order (LeRobot ignores the file):
the scene, and so the object's start pose, follows from the seed alone, which
benchmarks/pose_coverage.py uses.
"""
import argparse
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from data.aloha_expert import (EXPERT_STYLES, EXPERT_TASKS, HANDOVER_ONLY_STYLES, expert_replayed, rewards_of,
                               solved_step)
from data.lerobot_writer import LeRobotWriter
from data.sim_env import DEMO_SEEDS, SimEnv, SimTask, SimTaskError, check_seeds, get_task, make_env

DEFAULT_IMAGE_SIZE = (192, 256)  # the top camera's 3:4 at configs/aloha_sim.yaml's video size
PROVENANCE = "sim_demos.json"  # in meta/: the task, the expert's style and each episode's seed
ATTEMPTS_PER_EPISODE = 2   # give up when the expert fails on more than half the seeds it is given
NOISE_STEPS = 10           # --action-noise's correlation time, 0.2 s at 50 Hz: long enough to move the arm off
                           # the plan (a per-step draw is smoothed away by the position controller)
NOISE_DRAWS = 4            # offsets tried per seed before the seed counts as failed
_ENV: Dict[tuple, SimEnv] = {}  # per worker process: the env of (task, image size)


def features(task: SimTask, image_size: Tuple[int, int]) -> dict:
    from gym_aloha.constants import ACTIONS, JOINTS

    h, w = image_size
    return {task.state_key: {"dtype": "float32", "shape": [task.state_dim], "names": list(JOINTS)},
            "action": {"dtype": "float32", "shape": [task.action_dim], "names": list(ACTIONS)},
            task.image_key: {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"]}}


def replay(env: SimEnv, seed: int, actions: np.ndarray, handover_only: bool) -> Dict[str, Any]:
    """Execute `actions` from the scene of `seed`, rendering the camera before each. Returns the step
    that solved the task (-1: none; by a hand-over with `handover_only`: `solved_step`) and, per
    executed step, the state and frame before it."""
    env.reset(seed, observe=False)
    states, frames, rewards = [], [], []
    for action in actions:
        states.append(env.state())
        frames.append(env.render())
        rewards.append(env.step(action)[0])
    return {"solved": solved_step(rewards, handover_only), "state": np.asarray(states, np.float32), "frames": frames}


def arm_noise(seed: int, draw: int, steps: int, std: float) -> np.ndarray:
    """float32 [steps, 14]: --action-noise's offset for the scene of `seed`, its `draw`-th try; an
    Ornstein-Uhlenbeck process of stationary standard deviation `std` on the arms' joints (started
    in its stationary law), zero on the grippers."""
    from gym_aloha.constants import ACTIONS

    arms = [i for i, name in enumerate(ACTIONS) if not name.endswith("_gripper")]
    rng = np.random.default_rng([seed, draw])
    decay = np.exp(-1.0 / NOISE_STEPS)
    offset: np.ndarray = np.zeros((steps, len(ACTIONS)), np.float32)
    x = rng.normal(0.0, std, len(arms))
    for t in range(steps):
        offset[t, arms] = x
        x = decay * x + np.sqrt(1 - decay ** 2) * std * rng.normal(size=len(arms))
    return offset


def executed_actions(actions: np.ndarray, seed: int, std: float, draw: int) -> np.ndarray:
    """`actions` as --action-noise `std` executed them in the scene of `seed` on its `draw`-th try:
    plus `arm_noise`; unchanged when `std` is 0."""
    return actions + arm_noise(seed, draw, len(actions), std) if std > 0 else actions


def noisy_execution(env: SimEnv, seed: int, actions: np.ndarray, std: float,
                    handover_only: bool) -> Tuple[np.ndarray, int, int]:
    """The first of NOISE_DRAWS executions of `actions` plus `arm_noise` that solves the task (no
    rendering): (executed actions, solving step, draw), or (the last draw's, -1, -1) when none does."""
    for draw in range(NOISE_DRAWS):
        executed = executed_actions(actions, seed, std, draw)
        solved = solved_step(rewards_of(env, seed, executed), handover_only)
        if solved >= 0:
            return executed, solved, draw
    return executed, -1, -1


def record_episode(job: Tuple[str, int, Tuple[int, int], int, str, float]) -> dict:
    """One seed, in a worker: the expert's actions and the rewards of their unrendered replay (with
    `noise`, of a perturbed execution: `noisy_execution`), which decide success, then, if solved, a
    rendered replay up to `tail` steps past the solving step. The recorded actions are the expert's."""
    name, seed, image_size, tail, style, noise = job
    handover_only = style in HANDOVER_ONLY_STYLES
    start, cpu = time.perf_counter(), time.process_time()
    if (name, image_size) not in _ENV:
        _ENV[(name, image_size)] = make_env(name, image_size)
    env = _ENV[(name, image_size)]
    actions, rewards = expert_replayed(name, seed, style)
    solved, executed, draw = solved_step(rewards, handover_only), actions, -1
    if noise > 0:
        executed, solved, draw = noisy_execution(env, seed, actions, noise, handover_only)
    out: Dict[str, Any] = {"seed": seed, "solved": solved, "planned": len(actions), "noise_draw": draw}
    if solved >= 0:
        length = min(len(actions), solved + 1 + tail)
        run = replay(env, seed, executed[:length], handover_only)
        if run["solved"] != solved:  # the physics is deterministic: a mismatch is a bug, not bad luck
            raise RuntimeError(f"seed {seed}: the rendered replay solved at step {run['solved']}, "
                               f"the unrendered one at {solved}")
        out.update(state=run["state"], action=actions[:length], frames=np.stack(run["frames"]))
    out.update(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu)
    return out


def check_out(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise SimTaskError(f"--out {out} already exists and is not an empty folder; give a new path")


def generate(name: str, episodes: int, out: str, seed: int, image_size: Tuple[int, int], workers: int,
             tail: int, style: str = "default", noise: float = 0.0, log: Callable[[str], None] = print) -> dict:
    """Write `episodes` solved demonstrations of task `name` to `out`; returns the summary."""
    task = get_task(name)
    if task.name not in EXPERT_TASKS:
        raise SimTaskError(f"no scripted expert for task {name!r}; experts exist for: {', '.join(EXPERT_TASKS)}")
    if style not in EXPERT_STYLES:
        raise SimTaskError(f"expert style {style!r}; expected one of {', '.join(EXPERT_STYLES)}")
    if episodes < 1 or workers < 1 or tail < 0 or min(image_size) < 16 or not 0 <= noise < 1:
        raise SimTaskError(f"--episodes ({episodes}) and --workers ({workers}) must be >= 1, --tail ({tail}) >= 0, "
                           f"--image-size ({image_size[0]} {image_size[1]}) at least 16 16, "
                           f"--action-noise ({noise}) in [0, 1) radians")
    budget = ATTEMPTS_PER_EPISODE * episodes
    check_seeds([seed, seed + budget - 1], DEMO_SEEDS, "demonstration")
    check_out(out)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{os.getpid()}")
    writer = LeRobotWriter(tmp, task.fps, features(task, image_size), robot_type="aloha")
    start = time.perf_counter()
    kept: List[dict] = []
    tried: List[dict] = []
    next_seed = seed
    # spawn: each worker starts its own EGL context and MuJoCo state, none inherited from this process
    pool = multiprocessing.get_context("spawn").Pool(workers)
    try:
        while len(kept) < episodes:
            if len(tried) >= budget:
                raise SimTaskError(f"the expert solved {len(kept)} of {len(tried)} seeds from {seed}: fewer than "
                                   f"1 in {ATTEMPTS_PER_EPISODE}; {episodes} episodes were asked for")
            batch = range(next_seed, next_seed + min(episodes - len(kept), budget - len(tried)))
            next_seed = batch.stop
            jobs = [(name, s, (image_size[0], image_size[1]), tail, style, noise) for s in batch]
            for result in pool.imap(record_episode, jobs):
                tried.append(result)
                ok = result["solved"] >= 0
                log(f"seed {result['seed']:>7}  success {str(ok):5}  steps "
                    f"{(result['solved'] + 1) if ok else result['planned']:>4}  "
                    f"{result['seconds']:6.1f} s  (cpu {result['cpu_seconds']:.1f} s)")
                if ok and len(kept) < episodes:
                    writer.add_episode({task.state_key: result["state"], "action": result["action"],
                                        task.image_key: result["frames"]}, task.instruction)
                    kept.append(result)
        writer.close()
        provenance = {"task": name, "seeds": [r["seed"] for r in kept], "image_size": list(image_size), "tail": tail,
                      "expert_style": style, "action_noise": noise,
                      "noise_draws": [r["noise_draw"] for r in kept] if noise > 0 else None}
        with open(os.path.join(tmp, "meta", PROVENANCE), "w") as f:
            json.dump(provenance, f, indent=1)
        if os.path.isdir(out):  # empty (check_out): replaced by the finished dataset
            os.rmdir(out)
        os.rename(tmp, out)
    except BaseException:
        pool.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pool.close()
    pool.join()
    wall = time.perf_counter() - start
    solved = [r for r in tried if r["solved"] >= 0]
    summary = {"task": name, "out": out, "episodes": len(kept), "seeds_tried": len(tried),
               "expert_success_rate": len(solved) / len(tried),
               "solved_at_step_max": max(r["solved"] + 1 for r in solved),
               "wall_seconds": wall, "wall_seconds_per_episode": wall / len(tried),
               "worker_seconds_per_episode": float(np.mean([r["seconds"] for r in tried])),
               "cpu_seconds_per_episode": float(np.mean([r["cpu_seconds"] for r in tried])),
               "frames": int(sum(len(r["action"]) for r in kept)), "workers": workers}
    log(f"expert success {len(solved)}/{len(tried)} = {summary['expert_success_rate']:.1%} "
        f"(solved by step {summary['solved_at_step_max']} at the latest; cap {task.max_steps}); "
        f"{len(kept)} episodes, {summary['frames']} frames written to {out}")
    log(f"time: {wall:.0f} s wall on {workers} workers, {summary['wall_seconds_per_episode']:.1f} s wall per seed, "
        f"{summary['worker_seconds_per_episode']:.1f} s worker time and "
        f"{summary['cpu_seconds_per_episode']:.1f} s CPU per seed")
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="scripted simulator demonstrations -> LeRobot v3.0 dataset")
    parser.add_argument("--task", required=True, help="a task of data.sim_env.TASKS with a scripted expert")
    parser.add_argument("--episodes", type=int, required=True, help="solved episodes to write")
    parser.add_argument("--out", required=True, help="new folder for the dataset")
    parser.add_argument("--seed", type=int, default=DEMO_SEEDS.start, help="first seed (DEMO_SEEDS)")
    parser.add_argument("--image-size", type=int, nargs=2, default=DEFAULT_IMAGE_SIZE, metavar=("H", "W"),
                        help="rendered camera size (default: configs/aloha_sim.yaml's video size)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tail", type=int, default=10, help="steps kept after the step that solves the task")
    parser.add_argument("--expert-style", choices=EXPERT_STYLES, default="default",
                        help="handover_only: the right gripper points at the cube and only hand-overs are kept; "
                             "prefer_handover: the -x grasp that hands over, else the pointed one, else the default's "
                             "(data/aloha_expert.py)")
    parser.add_argument("--action-noise", type=float, default=0.0, metavar="STD",
                        help="radians: execute the arms' joint targets with a slowly varying offset of this standard "
                             "deviation and record the expert's own actions (demonstrations with recoveries, DART)")
    args = parser.parse_args(argv)
    # a kill (SIGTERM) unwinds like Ctrl-C: the workers stop and the temporary folder is removed
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        generate(args.task, args.episodes, args.out, args.seed, tuple(args.image_size), args.workers, args.tail,
                 args.expert_style, args.action_noise)
    except SimTaskError as e:
        print(f"data.sim_demos: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
