"""Serve a checkpoint as a websocket policy server speaking openpi-client's protocol.

    python -m inference.serve --checkpoint runs/tiny/<run> --port 8000 [--host 0.0.0.0] [--device cuda] \
        [--which best]

The protocol is openpi's (openpi_client.websocket_client_policy): on connect the server sends its
metadata (msgpack, numpy arrays as openpi_client.msgpack_numpy packs them): `observation_keys` (each
expected key with its `shape` and `dtype`), `action_shape` [chunk, action_dim] and more. Then each
binary message from the client is an observation dict, answered by `{"actions": float32 [chunk,
action_dim] in robot units, "server_timing": {...}}`. A malformed observation is answered by a text
message saying what is wrong (the client raises it as RuntimeError); the connection and the server
stay up. Requests arriving within `serving.batch_window_ms` of each other share one model call (at
most `serving.max_batch_size`). Every model call's size and latency is logged.
"""
import argparse
import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from openpi_client import msgpack_numpy

from checkpoint.layout import WHICH
from checkpoint.finetune import WEIGHT_SETS
from inference.load import CheckpointError, load_checkpoint
from inference.policy import Policy

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection

log = logging.getLogger("serve")


class ServedPolicy(Protocol):
    """What BatchingServer serves: inference.policy.Policy, or inference.constant_policy.ConstantPolicy."""

    @property
    def loaded(self) -> Any: ...  # anything with a `checkpoint` (a Loaded, or a stand-in), for the log line

    def metadata(self) -> dict[str, Any]: ...

    def check(self, obs: Any) -> Any: ...  # an untrusted observation -> what infer_checked takes; raises if bad

    def infer_checked(self, checked: list[Any]) -> np.ndarray: ...


Timing = dict[str, float]
"""A request's server_timing: infer_ms, batch_size, total_ms."""
Request = tuple[Any, "asyncio.Future[tuple[np.ndarray, Timing]]"]
"""A checked observation waiting for its batch, and the future its (actions, timing) answer comes by."""


class BatchingServer:
    def __init__(self, policy: ServedPolicy, max_batch_size: int, batch_window_ms: float) -> None:
        self.policy, self.max_batch, self.window = policy, max_batch_size, batch_window_ms / 1000
        self.queue: asyncio.Queue[Request] | None = None  # made inside the server's event loop (serve)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # one model call at a time

    async def handle(self, websocket: "ServerConnection") -> None:
        from websockets.exceptions import ConnectionClosed

        log.info("client %s connected", websocket.remote_address)
        try:
            await self.answer(websocket)
        except ConnectionClosed:  # the robot went away, cleanly or not: nothing to answer
            pass
        log.info("client %s disconnected", websocket.remote_address)

    async def answer(self, websocket: "ServerConnection") -> None:
        await websocket.send(msgpack_numpy.packb(self.policy.metadata()))
        async for message in websocket:
            start = time.perf_counter()
            try:
                if isinstance(message, str):
                    raise ValueError("expected a binary msgpack message (openpi_client packs observations so)")
                checked = self.policy.check(msgpack_numpy.unpackb(message))
            except Exception as e:  # untrusted input: whatever it is, that client is told and the server goes on
                log.warning("malformed observation from %s: %s", websocket.remote_address, e)
                await websocket.send(f"malformed observation: {e}")
                continue
            future: asyncio.Future[tuple[np.ndarray, Timing]] = asyncio.get_running_loop().create_future()
            assert self.queue is not None
            await self.queue.put((checked, future))
            try:
                actions, timing = await future
            except Exception as e:  # a failed model call: every request in its batch is told
                await websocket.send(f"inference failed: {type(e).__name__}: {e}")
                continue
            timing["total_ms"] = (time.perf_counter() - start) * 1000
            await websocket.send(msgpack_numpy.packb({"actions": actions, "server_timing": timing}))

    async def _collect(self) -> list[Request]:
        """The first waiting request, then whatever else arrives within the batching window."""
        assert self.queue is not None
        items = [await self.queue.get()]
        deadline = time.perf_counter() + self.window
        while len(items) < self.max_batch:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                items.append(await asyncio.wait_for(self.queue.get(), left))
            except asyncio.TimeoutError:
                break
        return items

    async def batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = await self._collect()
            start = time.perf_counter()
            try:
                actions = await loop.run_in_executor(self.executor, self.policy.infer_checked, [c for c, _ in items])
            except Exception as e:
                log.exception("model call on a batch of %d failed", len(items))
                for _, future in items:
                    if not future.done():
                        future.set_exception(e)
                continue
            infer_ms = (time.perf_counter() - start) * 1000
            log.info("batch of %d: %.1f ms model call", len(items), infer_ms)
            for k, (_, future) in enumerate(items):
                if not future.done():
                    future.set_result((actions[k], {"infer_ms": infer_ms, "batch_size": len(items)}))

    async def serve(self, host: str, port: int, ready: threading.Event | None = None) -> None:
        from websockets.asyncio.server import serve

        self.queue = asyncio.Queue()
        batcher = asyncio.create_task(self.batches())
        async with serve(self.handle, host, port, compression=None, max_size=None) as server:
            log.info("serving %s on ws://%s:%d", self.policy.loaded.checkpoint, host, port)
            print(f"serving on ws://{host}:{port}", flush=True)
            if ready is not None:
                ready.set()
            try:
                await server.serve_forever()
            finally:
                batcher.cancel()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint_step_N folder, a run folder or an export")
    p.add_argument("--which", choices=WHICH, default="latest",
                   help="with a run folder: its newest verified checkpoint (latest, default) or the one with the "
                        "highest closed-loop success (best: the run's `best` file)")
    p.add_argument("--config", default=None, help="a recipe YAML replacing the checkpoint's config")
    p.add_argument("--host", default="0.0.0.0", help="interface to listen on (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--weights", choices=WEIGHT_SETS, default=None,
                   help="ema or raw; default: the EMA weights when the checkpoint has them (training.ema), else raw")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default model.inference.num_inference_timesteps)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. serving.image_keys=[observation/image]")
    return p.parse_intermixed_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.serialization import ModelLoadError
    from utils.config import ConfigError
    try:
        loaded = load_checkpoint(args.checkpoint, args.config, args.overrides, args.device, args.weights, args.which)
    except (CheckpointError, ConfigError, ModelLoadError) as e:
        sys.exit(f"serve failed: {e}")
    sv = loaded.cfg.serving
    server = BatchingServer(Policy(loaded, args.steps), sv.max_batch_size, sv.batch_window_ms)
    try:
        asyncio.run(server.serve(args.host, args.port))
    except KeyboardInterrupt:
        log.info("stopped")
    except OSError as e:  # the port is taken, or the host is not an address of this machine
        sys.exit(f"serve failed: cannot listen on {args.host}:{args.port}: {e}")


if __name__ == "__main__":
    main()
