"""A policy that answers every observation with one fixed action chunk, served by inference.serve's own
BatchingServer (the same protocol and batching): the floor of what a policy costs in a rollout, for
benchmarks/rollout_overhead.py and the rollout's contract tests, and a way to check an env driver
against the server contract without a trained checkpoint.

It asks for the keys a task's LeRobot features name (or any keys given) and checks every observation
against them as inference.policy.Policy does; the observations it accepted are kept in `received`.
"""
import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from types import SimpleNamespace

import numpy as np

if TYPE_CHECKING:
    from data.sim_env import SimTask
    from inference.policy import KeySpec
    from inference.serve import ServedPolicy


class ConstantPolicy:
    def __init__(self, action: Sequence[float] | np.ndarray, chunk: int, observation_keys: dict[str, "KeySpec"],
                 checkpoint: str = "constant-policy") -> None:
        self.action = np.asarray(action, dtype=np.float32)
        self.chunk, self.keys = int(chunk), observation_keys
        self.loaded = SimpleNamespace(checkpoint=checkpoint)  # what BatchingServer logs
        self.received: list[dict[str, Any]] = []

    @classmethod
    def for_task(cls, task: "SimTask", action: Sequence[float] | np.ndarray, chunk: int,
                 image_size: tuple[int, int]) -> "ConstantPolicy":
        keys: dict[str, "KeySpec"] = {task.image_key: {"shape": [*image_size, 3], "dtype": "uint8"},
                                      task.state_key: {"shape": [task.state_dim], "dtype": "float32"},
                                      "prompt": {"shape": [], "dtype": "str"}}
        return cls(action, chunk, keys)

    def metadata(self) -> dict[str, Any]:
        return {"observation_keys": self.keys, "action_shape": [self.chunk, len(self.action)],
                "action_chunk_size": self.chunk, "action_dim": len(self.action),
                "checkpoint": self.loaded.checkpoint, "config_hash": None, "weights": None}

    def check(self, obs: dict[str, Any]) -> dict[str, Any]:
        missing = [k for k in self.keys if k not in obs]
        if missing:
            raise ValueError(f"observation lacks {missing}")
        for key, spec in self.keys.items():
            value = obs[key]
            if spec["dtype"] == "str":
                ok = isinstance(value, str)
            else:
                ok = isinstance(value, np.ndarray) and list(value.shape) == spec["shape"] and (
                    value.dtype == np.uint8 if spec["dtype"] == "uint8" else value.dtype.kind == "f")
            if not ok:
                raise ValueError(f"{key!r} must be {spec['dtype']} of shape {spec['shape']}")
        self.received.append(obs)
        return obs

    def infer_checked(self, checked: list[dict[str, Any]]) -> np.ndarray:
        return np.broadcast_to(self.action, (len(checked), self.chunk, len(self.action))).copy()


def serve_in_thread(policy: "ServedPolicy", port: int, batch_window_ms: float = 5.0,
                    max_batch_size: int = 8) -> Callable[[], None]:
    """Serve `policy` on 127.0.0.1:port from a daemon thread; returns stop()."""
    from inference.serve import BatchingServer

    server = BatchingServer(policy, max_batch_size, batch_window_ms)
    ready = threading.Event()
    state: dict[str, Any] = {}

    def run() -> None:
        async def main() -> None:
            state["loop"], state["task"] = asyncio.get_running_loop(), asyncio.current_task()
            await server.serve("127.0.0.1", port, ready)
        try:
            asyncio.run(main())
        except asyncio.CancelledError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(60):
        raise RuntimeError(f"the constant policy server did not start on port {port}")

    def stop() -> None:
        state["loop"].call_soon_threadsafe(state["task"].cancel)
        thread.join(30)
    return stop
