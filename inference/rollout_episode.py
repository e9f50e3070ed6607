"""One closed-loop episode in a simulator (data/sim_env.py), run inside a rollout worker process.

An episode is (arm, seed): arm "policy" queries the websocket policy server (openpi-client's
WebsocketClientPolicy) and executes each action chunk open-loop for `replan` steps; the baselines run
locally: "hold" sends the initial state as the action every step (the robot holds its start pose),
"expert" replays data.aloha_expert.expert_trajectory(task, seed) (ALOHA only). The episode ends at
success (as the registered envs terminate) or after `steps` steps.

A recorded episode writes an npz: `actions` [T, action_dim] as executed, `states` [T, state_dim] as
observed before each action, `queries` (the steps whose action opened a new chunk) and `rewards`;
where a chunk joins the next is where policies with open-loop chunks tend to jerk.

The simulator renders only when the policy needs a picture (once per chunk) or, in a video episode,
once per step; every second of the episode is booked as simulator (reset, physics, rendering), policy
(the server round trip) or rest (this module's own work).
"""
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:
    from data.sim_env import SimTask

ARMS = ("policy", "hold", "expert")
VIDEO_MIN_SIDE = 240  # frames are upscaled (nearest, by an integer factor) so a player shows them at a visible size


class EpisodeError(RuntimeError):
    """An episode that cannot go on (the server refused an observation, an expert trajectory of the wrong
    shape): the message says which episode and why."""


@dataclass(frozen=True)
class Plan:
    """What every episode of one rollout shares (sent once to each worker)."""
    task: str
    image_size: Tuple[int, int]           # (H, W) rendered for the server (its metadata's image shape)
    steps: int                            # episode cap
    replan: int                           # actions executed from each chunk before the next query
    uri: Optional[str] = None             # the policy server (None: baselines only)
    send: Dict[str, str] = field(default_factory=dict)  # server key -> "image" | "state" | "prompt"


@dataclass
class Episode:
    arm: str
    seed: int
    success: bool
    max_reward: float
    steps: int
    wall_s: float
    simulator_s: float
    policy_s: float
    rewards: List[float]
    latencies_ms: List[float]
    video: Optional[str] = None
    record: Optional[str] = None

    @property
    def rest_s(self) -> float:
        return max(self.wall_s - self.simulator_s - self.policy_s, 0.0)


class _Clock:
    """Accumulates seconds spent in one kind of work."""

    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self.start


_worker: dict = {}  # this process's env and server connection, made once per worker


def init_worker(plan: Plan, ignore_sigint: bool = True) -> None:
    """Pool initializer: the env is created here, inside the worker (MuJoCo's EGL context is per process)."""
    if ignore_sigint:  # Ctrl-C is the parent's to handle: it stops the pool, the server and cleans up
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from data.sim_env import make_env

    _worker.clear()
    _worker.update(plan=plan, env=make_env(plan.task, plan.image_size), client=None)
    if plan.uri is not None:  # connected once, before any episode's clock runs
        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        _worker["client"] = WebsocketClientPolicy(plan.uri)


def close_worker() -> None:
    """End this process's server connection and env (a pool worker's end with its process)."""
    if _worker.get("client") is not None:
        _worker["client"]._ws.close()  # openpi-client has no close()
    if _worker.get("env") is not None:
        _worker["env"].close()
    _worker.clear()


def _expert_actions(task: str, seed: int, action_dim: int) -> np.ndarray:
    from data.aloha_expert import expert_trajectory  # lazily: ALOHA's alone (rollout.check_args imported it once)

    try:
        actions = np.asarray(expert_trajectory(task, seed), dtype=np.float32)
    except Exception as e:  # the expert's own refusal (a task it has no plan for) ends the rollout with its words
        raise EpisodeError(f"data.aloha_expert.expert_trajectory({task!r}, {seed}) failed: "
                           f"{type(e).__name__}: {e}") from None
    if actions.ndim != 2 or actions.shape[1] != action_dim or len(actions) == 0:
        raise EpisodeError(f"data.aloha_expert.expert_trajectory({task!r}, {seed}) returned shape "
                           f"{list(actions.shape)}; expected [T, {action_dim}]")
    return actions


def upscale(frame: np.ndarray) -> np.ndarray:
    k = max(1, math.ceil(VIDEO_MIN_SIDE / min(frame.shape[:2])))
    k += k % 2  # yuv420p needs even sides
    return frame.repeat(k, axis=0).repeat(k, axis=1)


def run_episode(arm: str, seed: int, video_path: Optional[str] = None, record_path: Optional[str] = None) -> Episode:
    """Run one episode in this worker's env; `video_path`: write an mp4 of every step there; `record_path`:
    the npz of its actions, states and queries."""
    plan, env = _worker["plan"], _worker["env"]
    task = env.task
    sim, pol = _Clock(), _Clock()
    start = time.perf_counter()
    with sim:
        first = env.reset(seed)  # it renders: the picture of the policy's first query and of a video's first frame
        initial = env.state()
    frame = first[task.image_key]
    frames = [frame] if video_path is not None else []
    none = np.empty((0, task.action_dim), np.float32)
    expert = _expert_actions(task.name, seed, task.action_dim) if arm == "expert" else none
    chunk, success = none, False
    rewards: List[float] = []
    latencies: List[float] = []
    actions, states, queries = [], [], []
    for t in range(plan.steps):
        state = None  # read once a step, by the query or the record, whichever comes first
        if arm == "hold":
            action = initial
        elif arm == "expert":
            action = expert[min(t, len(expert) - 1)]  # past its end the expert holds its last pose
        else:
            if t % plan.replan == 0:
                if frame is None:
                    with sim:
                        frame = env.render()
                with sim:
                    state = env.state()
                chunk = _query(plan, task, frame, state, latencies, pol, seed, t)
                queries.append(t)
            action = chunk[t % plan.replan]
        if record_path is not None:
            if state is None:
                with sim:
                    state = env.state()
            states.append(state)
            actions.append(action)
        with sim:
            reward, success = env.step(action)
            frame = env.render() if video_path is not None else None
        rewards.append(reward)
        if video_path is not None:
            frames.append(frame)
        if success:
            break
    if video_path is not None:
        _write_video(video_path, frames, task.fps)
    if record_path is not None:
        np.savez(record_path, actions=np.asarray(actions, np.float32), states=np.asarray(states, np.float32),
                 queries=np.asarray(queries, np.int64), rewards=np.asarray(rewards, np.float64))
    wall = time.perf_counter() - start
    return Episode(arm, seed, bool(success), float(max(rewards)), len(rewards), wall, sim.total, pol.total,
                   rewards, latencies, os.path.basename(video_path) if video_path else None,
                   os.path.basename(record_path) if record_path else None)


def _query(plan: Plan, task: "SimTask", image: np.ndarray, state: np.ndarray, latencies: List[float], clock: _Clock,
           seed: int, t: int) -> np.ndarray:
    values = {"image": image, "state": state, "prompt": task.instruction}
    obs = {key: values[role] for key, role in plan.send.items()}
    sent = time.perf_counter()
    from websockets.exceptions import ConnectionClosed

    with clock:
        try:
            answer = _worker["client"].infer(obs)
        except RuntimeError as e:  # the server answered with an error text
            raise EpisodeError(f"seed {seed}, step {t}: the policy server refused the observation: {e}") from None
        except (ConnectionClosed, OSError) as e:
            raise EpisodeError(f"seed {seed}, step {t}: lost the policy server {plan.uri} "
                               f"({type(e).__name__}: {e})") from None
    latencies.append((time.perf_counter() - sent) * 1000)
    actions = np.asarray(answer["actions"], dtype=np.float32)
    if actions.ndim != 2 or actions.shape[0] < plan.replan or actions.shape[1] != task.action_dim:
        raise EpisodeError(f"seed {seed}, step {t}: the policy server answered actions of shape {list(actions.shape)}; "
                           f"expected [>= {plan.replan}, {task.action_dim}]")
    return actions


def _write_video(path: str, frames: List[np.ndarray], fps: float) -> None:
    from utils.video_file import VideoEncoder

    big = [upscale(f) for f in frames]
    h, w = big[0].shape[:2]
    encoder = VideoEncoder(path, fps, w, h, codec="libx264", crf=23, gop=None)
    for f in big:
        encoder.write(f)
    encoder.close()
