"""The policy server (python -m inference.serve) queried by openpi-client's real WebsocketClientPolicy
from this process, concurrently, with well-formed and malformed observations."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import ROOT
from test_inference import tiny_checkpoint  # noqa: F401  (the shared session fixture)
from utils.dist import free_port

HANG_GUARD_S = 300  # start-up (model load) and the queries: a hang fails, a slow machine does not


def observation(seed):
    rng = np.random.default_rng(seed)
    return {"observation/image": rng.integers(0, 256, (48, 64, 3), dtype=np.uint8),
            "observation/state": rng.uniform(0, 1, 8).astype(np.float32),
            "prompt": "move the red square and the blue square to the dots"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):  # noqa: F811
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "inference.serve", "--checkpoint", tiny_checkpoint, "--host",
                             "127.0.0.1", "--port", str(port), "--steps", "2",
                             # wait up to 2 s for 3 requests: the concurrent ones below surely share a call
                             "serving.batch_window_ms=2000", "serving.max_batch_size=3"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not any("serving on ws://" in line for line in lines):
        assert proc.poll() is None, "server exited:\n" + "".join(lines)
        assert time.monotonic() < deadline, "server did not start:\n" + "".join(lines)
        time.sleep(0.2)
    yield port, lambda: WebsocketClientPolicy("127.0.0.1", port), proc, lines
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):  # noqa: F811
    """The in-process policy the server must agree with."""
    from inference.load import load_checkpoint
    from inference.policy import Policy

    loaded = load_checkpoint(tiny_checkpoint)
    return Policy(loaded, num_steps=2)


def test_metadata_describes_the_observation_and_the_chunk(server, reference):
    _, connect, _, _ = server
    meta = connect().get_server_metadata()
    assert meta["observation_keys"] == {"observation/image": {"shape": [48, 64, 3], "dtype": "uint8"},
                                        "observation/state": {"shape": [8], "dtype": "float32"},
                                        "prompt": {"shape": [], "dtype": "str"}}
    assert meta["action_shape"] == [8, 4] and meta["num_inference_timesteps"] == 2
    assert meta["weights"] == reference.loaded.weights == "raw"  # tiny.yaml trains without the EMA


def test_concurrent_clients_get_the_in_process_actions_and_bad_requests_an_error(server, reference):
    _, connect, proc, lines = server
    n = 4
    results, errors = [None] * n, [None] * n
    barrier = threading.Barrier(n)

    def client(k):
        policy = connect()
        barrier.wait()
        if k == n - 1:  # this client first sends malformed observations, then a good one
            bad = observation(k)
            bad["observation/image"] = bad["observation/image"][:10]
            with pytest.raises(RuntimeError, match="'observation/image' must be a uint8 array of shape"):
                policy.infer(bad)
            with pytest.raises(RuntimeError, match="lacks \\['prompt'\\]"):
                policy.infer({k: v for k, v in observation(k).items() if k != "prompt"})
            errors[k] = "checked"
        results[k] = policy.infer(observation(k))["actions"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert errors[n - 1] == "checked" and all(r is not None for r in results), "".join(lines[-40:])
    expected = reference.infer([observation(k) for k in range(n)])
    for k in range(n):
        assert results[k].shape == (8, 4) and results[k].dtype == np.float32
        np.testing.assert_allclose(results[k], expected[k], atol=1e-6, rtol=0)
    assert proc.poll() is None
    batched = [int(line.split("batch of ")[1].split(":")[0]) for line in lines if "batch of " in line]
    assert max(batched) > 1, lines[-20:]  # concurrent requests shared a model call


def test_garbage_bytes_get_an_error_and_the_server_keeps_serving(server, reference):
    import websockets.sync.client
    from openpi_client import msgpack_numpy

    port, connect, proc, _ = server
    with websockets.sync.client.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        msgpack_numpy.unpackb(ws.recv())  # metadata
        ws.send(b"\xc1 not msgpack")
        assert ws.recv().startswith("malformed observation")
        ws.send("a text frame")
        assert "binary msgpack" in ws.recv()
    got = connect().infer(observation(7))["actions"]
    np.testing.assert_allclose(got, reference.infer([observation(7)])[0], atol=1e-6, rtol=0)
    assert proc.poll() is None


@pytest.mark.parametrize("horizon", [None, 3])
def test_relative_action_dims_add_the_observed_state_back(reference, horizon):
    """dataset.relative_action_dims: the served action of such a dim is the model's output scaled, plus the
    observed state (not the mean action), faded into the mean over dataset.relative_action_horizon; every
    other dim as before. The same model, seeds and inputs."""
    from dataclasses import replace

    from data.normalize import NormStats
    from inference.policy import Policy

    stats = reference.loaded.stats
    fitted = NormStats.from_dict(stats.to_dict(), relative_dims=[0, 2], relative_horizon=horizon)
    relative = Policy(replace(reference.loaded, stats=fitted), num_steps=2)
    obs = [observation(k) for k in range(2)]
    absolute, got = reference.infer(obs), relative.infer(obs)
    mean = np.asarray(stats.stats[stats.action_key]["mean"], np.float32)
    states = np.stack([o["observation/state"] for o in obs])
    chunk = absolute.shape[1]
    w = np.ones(chunk) if horizon is None else np.clip(1 - np.arange(chunk) / horizon, 0, 1)
    want = absolute.copy()
    want[..., [0, 2]] += w[None, :, None] * (states[:, None, [0, 2]] - mean[[0, 2]])
    if horizon is not None:
        np.testing.assert_array_equal(got[:, horizon:], absolute[:, horizon:])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert not np.allclose(got, absolute, atol=1e-3)
