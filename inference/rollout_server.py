"""The policy server side of a rollout: start `python -m inference.serve` for --checkpoint (and stop it),
and map a simulated task's observation onto the keys the server's metadata asks for.

The mapping is by role, not by name: a recipe serves its camera under its own key (the tiny recipe:
`observation/image`) while the task records it as a LeRobot feature (`observation.images.top`). The
server's metadata says which key is which: a uint8 [H, W, 3] entry is a camera, a float [D] entry the
state, a "str" entry the instruction. The task gives one camera, one state and one instruction; a server
that asks for anything else is refused naming both sides.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Dict, Tuple

from utils.child import bound_to_parent
from utils.dist import free_port

if TYPE_CHECKING:
    from data.sim_env import SimTask

START_GUARD_S = 600  # loading a large checkpoint takes minutes; a server that never answers is a hang


class RolloutError(RuntimeError):
    """A rollout that cannot run as asked: the message names the value and what was expected."""


def observation_roles(task: "SimTask", meta: dict[str, Any], where: str) -> Tuple[Dict[str, str], Tuple[int, int]]:
    """-> ({server key: "image" | "state" | "prompt"}, the (H, W) to render) for `task` against the
    server's metadata `meta`; RolloutError naming both sides when they do not fit. `where` names the server."""
    keys = meta.get("observation_keys")
    shape = meta.get("action_shape")
    if not isinstance(keys, dict) or not isinstance(shape, (list, tuple)) or len(shape) != 2:
        raise RolloutError(f"the policy server {where} sent metadata without observation_keys and action_shape "
                           f"[chunk, action_dim] (got keys {sorted(meta)}); is it an inference.serve server?")
    if int(shape[1]) != task.action_dim:
        raise RolloutError(f"the policy {where} ({meta.get('checkpoint', 'checkpoint unknown')}) outputs "
                           f"{shape[1]}-D actions (action_shape {list(shape)}), but task {task.name!r} "
                           f"({task.gym_id}) takes {task.action_dim}-D actions")
    provides = (f"task {task.name!r} provides one camera {task.image_key!r}, the state {task.state_key!r} "
                f"[{task.state_dim}] and an instruction")
    roles, images = {}, []
    for key, spec in keys.items():
        dtype, dims = spec.get("dtype"), list(spec.get("shape", []))
        if dtype == "uint8" and len(dims) == 3 and dims[2] == 3:
            roles[key] = "image"
            images.append((key, dims))
        elif dtype == "str":
            roles[key] = "prompt"
        elif dtype is not None and dtype.startswith("float") and len(dims) == 1:
            if dims != [task.state_dim]:
                raise RolloutError(f"the policy server {where} asks for the state {key!r} of shape {dims}; {provides}")
            roles[key] = "state"
        else:
            raise RolloutError(f"the policy server {where} asks for {key!r} ({dtype} {dims}), which the task cannot "
                               f"give; {provides}")
    counts = {r: list(roles.values()).count(r) for r in ("image", "state", "prompt")}
    if counts["image"] != 1 or counts["state"] > 1 or counts["prompt"] > 1:
        raise RolloutError(f"the policy server {where} asks for {len(images)} camera(s) {[k for k, _ in images]}, "
                           f"{counts['state']} state key(s) and {counts['prompt']} instruction key(s) "
                           f"({sorted(keys)}); {provides}")
    height, width, _ = images[0][1]
    return roles, (int(height), int(width))


class ServerProcess:
    """`python -m inference.serve --checkpoint PATH --which WHICH` on a free loopback port, its output in
    `log_path`; `start()` returns once it answers; `stop()` always ends it."""

    def __init__(self, checkpoint: str, log_path: str, device: str = "cpu", overrides: Sequence[str] = (),
                 which: str = "latest") -> None:
        self.checkpoint, self.log_path = checkpoint, log_path
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "inference.serve", "--checkpoint", checkpoint, "--which", which,
                    "--host", "127.0.0.1", "--port", str(self.port), "--device", device, *overrides]
        self.proc: subprocess.Popen[str] | None = None

    @property
    def uri(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> str:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "w")
        # its own session: a Ctrl-C reaches the rollout, which stops the server itself
        self.proc = bound_to_parent(self.cmd, signal.SIGTERM, cwd=root, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        self._reader = threading.Thread(target=self._copy_output, args=(ready,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_GUARD_S
        while not ready.wait(0.2):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader copy the last lines
                raise RolloutError(f"the policy server for --checkpoint {self.checkpoint} exited with code "
                                   f"{self.proc.returncode} before serving:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise RolloutError(f"the policy server for --checkpoint {self.checkpoint} did not answer within "
                                   f"{START_GUARD_S} s:\n{self.tail()}")
        return self.uri

    def _copy_output(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None  # started, with stdout=PIPE
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if "serving on ws://" in line:
                ready.set()

    def tail(self, lines: int = 15) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-lines:]).rstrip()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)  # its output ends with the process
        self._log.close()
