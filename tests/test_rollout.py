"""python -m inference.rollout: episodes in the real simulators (data.sim_env) against a policy server
queried through openpi-client. A constant policy behind inference.serve's BatchingServer checks the
contract and the numbers (rewards by hand, the observations the server got, the interval); a real
`inference.serve` of an untrained 14-D export of the tiny architecture checks the --checkpoint path and
the wrong-action-dim error; bad input gets one message and leaves nothing behind."""
import functools
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from helpers import ROOT
from utils.dist import free_port

PUSHT_SEEDS = [1_000_003, 1_000_004, 1_000_005]  # holding still, two of these three score a reward within 20 steps
PUSHT_ACTION = [256.0, 256.0]


def rollout(*args):
    from inference.rollout import main

    return main([str(a) for a in args])


def aloha_start_pose():
    from gym_aloha.constants import START_ARM_POSE  # joints of both arms, grippers as normalised 0.5

    return np.concatenate([START_ARM_POSE[:6], [0.5], START_ARM_POSE[8:14], [0.5]]).astype(np.float32)


@functools.lru_cache(maxsize=None)
def sim(task, image_size):
    from data.sim_env import make_env

    return make_env(task, image_size)


def by_hand(task, seed, steps, action_of, image_size):
    """Rewards of stepping the env as the rollout should: action_of(t, initial_state)."""
    env = sim(task, image_size)
    env.reset(seed)
    initial, rewards = env.state(), []
    for t in range(steps):
        reward, success = env.step(action_of(t, initial))
        rewards.append(reward)
        if success:
            break
    return rewards


@pytest.fixture
def constant_server():
    """serve(task name, action, chunk, image size, keys=None) -> (ws uri, the ConstantPolicy)."""
    from data.sim_env import get_task
    from inference.constant_policy import ConstantPolicy, serve_in_thread

    stops = []

    def serve(name, action, chunk, image_size, keys=None):
        policy = ConstantPolicy.for_task(get_task(name), action, chunk, image_size)
        if keys is not None:
            policy.keys = keys
        port = free_port()
        stops.append(serve_in_thread(policy, port))
        return f"ws://127.0.0.1:{port}", policy
    yield serve
    for stop in stops:
        stop()


def no_leftovers(parent, out):
    assert not os.path.exists(out)
    assert not [p for p in os.listdir(parent) if ".partial_" in p]


def test_wilson_interval_is_the_textbook_value():
    from inference.rollout_report import wilson_interval

    # the bounds are the roots x of (p - x)² = z² x (1 - x) / n, z = 1.959964 (solved on paper, 6 digits)
    np.testing.assert_allclose(wilson_interval(7, 10), [0.396778, 0.892209], atol=1e-6)
    np.testing.assert_allclose(wilson_interval(0, 5), [0.0, 0.434482], atol=1e-6)  # z² / (5 + z²)
    np.testing.assert_allclose(wilson_interval(50, 50), [0.928652, 1.0], atol=1e-6)  # 50 / (50 + z²)


def test_pusht_constant_policy_and_hold_give_the_rewards_of_stepping_by_hand(constant_server, tmp_path):
    from data.sim_env import get_task
    from inference.rollout_report import wilson_interval

    uri, policy = constant_server("pusht", PUSHT_ACTION, 8, (96, 96))
    out = tmp_path / "report"
    report = rollout("--task", "pusht", "--policy", uri, "--episodes", 3, "--seed", PUSHT_SEEDS[0], "--steps", 20,
                     "--replan", 5, "--workers", 2, "--videos", 1, "--baselines", "hold", "--out", out)
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    assert report["seeds"] == PUSHT_SEEDS and report["episodes"] == 3 and report["image_size"] == [96, 96]
    assert report["policy"]["checkpoint"] == "constant-policy" and report["replan"] == 5
    assert report["observation_map"] == {"observation.image": "observation.image",
                                         "observation.state": "observation.state", "instruction": "prompt"}
    results = report["results"]
    for arm, action_of in (("policy", lambda t, s: np.float32(PUSHT_ACTION)), ("hold", lambda t, s: s)):
        rows = results[arm]["per_episode"]
        assert [r["seed"] for r in rows] == PUSHT_SEEDS
        for row in rows:
            rewards = by_hand("pusht", row["seed"], 20, action_of, (96, 96))
            assert row["steps"] == len(rewards) and row["max_reward"] == max(row["rewards"])
            # gym-pusht's coverage differs in its last bit between env instances of one process
            # (0.6753084915937285 in the first, ...286 in later ones): equal to 1e-12
            np.testing.assert_allclose(row["rewards"], rewards, rtol=1e-12, atol=0)
        wins = sum(r["success"] for r in rows)
        assert results[arm]["successes"] == wins and results[arm]["wilson_95"] == wilson_interval(wins, 3)
    assert sum(r["max_reward"] > 0 for r in results["hold"]["per_episode"]) == 2  # the numbers are not all zero
    assert results["policy"]["per_episode"][0]["max_reward"] != results["hold"]["per_episode"][0]["max_reward"]

    # every chunk was asked for once per 5 steps, with the picture and state the env shows at reset
    steps = sum(r["steps"] for r in results["policy"]["per_episode"])
    assert results["policy"]["latency_ms"]["queries"] == len(policy.received) == 3 * math.ceil(20 / 5) == steps // 5
    env, task = sim("pusht", (96, 96)), get_task("pusht")
    for seed in PUSHT_SEEDS:
        first = env.reset(seed)
        assert any(np.array_equal(o["observation.image"], first["observation.image"]) and
                   np.array_equal(o["observation.state"], first["observation.state"]) for o in policy.received)
    assert {o["prompt"] for o in policy.received} == {task.instruction}
    assert {o["observation.image"].shape for o in policy.received} == {(96, 96, 3)}

    split = report["time_split"]
    assert split["simulator_s"] > 0 and split["policy_s"] > 0
    assert abs(split["simulator_fraction"] + split["policy_fraction"] + split["rest_fraction"] - 1) < 1e-9

    import av

    assert results["policy"]["per_episode"][0]["video"] == f"policy_seed{PUSHT_SEEDS[0]}.mp4"
    assert all("video" not in r for r in results["policy"]["per_episode"][1:])
    with av.open(str(out / f"policy_seed{PUSHT_SEEDS[0]}.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) == 21  # the reset picture and one per step
    assert sorted(os.listdir(out)) == ["policy_seed1000003.mp4", "report.json", "report.md", "rollout.png"]
    md = (out / "report.md").read_text()
    assert "![success per seed and reward curves](rollout.png)" in md and f"| hold | {PUSHT_SEEDS[2]} |" in md
    assert os.listdir(tmp_path) == ["report"]  # no partial folder beside it


def test_expert_baseline_replays_the_expert_s_trajectory_and_holds_its_last_pose(constant_server, tmp_path,
                                                                                  monkeypatch):
    """data.aloha_expert is another branch's: a stand-in with its signature shows the baseline's plumbing."""
    start = aloha_start_pose()
    calls = []

    def expert_trajectory(task_name, seed):
        calls.append((task_name, seed))
        rng = np.random.default_rng(seed)
        return (start + rng.normal(0, 0.05, (7, 14))).astype(np.float32)  # shorter than the episode

    monkeypatch.setitem(sys.modules, "data.aloha_expert", types.SimpleNamespace(expert_trajectory=expert_trajectory))
    uri, _ = constant_server("transfer_cube", start, 4, (24, 32))
    out = tmp_path / "report"
    report = rollout("--task", "transfer_cube", "--policy", uri, "--episodes", 2, "--steps", 10, "--workers", 1,
                     "--videos", 0, "--record", 1, "--out", out)  # default baselines for ALOHA: expert and hold
    assert list(report["results"]) == ["policy", "expert", "hold"]
    seeds = report["seeds"]
    assert calls == [("transfer_cube", s) for s in seeds]
    for row, seed in zip(report["results"]["expert"]["per_episode"], seeds):
        trajectory = expert_trajectory("transfer_cube", seed)
        assert row["rewards"] == by_hand("transfer_cube", seed, 10, lambda t, s: trajectory[min(t, 6)], (24, 32))
        assert row["steps"] == 10
    assert report["results"]["policy"]["latency_ms"]["queries"] == 2 * 3  # steps 0, 4, 8

    # --record 1: the first policy episode's executed actions, the states before them and its query steps
    first = report["results"]["policy"]["per_episode"][0]
    assert first["record"] == f"policy_seed{seeds[0]}.npz"
    assert "record" not in report["results"]["policy"]["per_episode"][1]
    assert sorted(p for p in os.listdir(out) if p.endswith(".npz")) == [first["record"]]
    recorded = np.load(out / first["record"])
    env = sim("transfer_cube", (24, 32))
    env.reset(seeds[0])
    states = []
    for _ in range(10):
        states.append(env.state())
        env.step(start)
    np.testing.assert_array_equal(recorded["states"], np.stack(states))
    np.testing.assert_array_equal(recorded["actions"], np.tile(start, (10, 1)))
    assert recorded["queries"].tolist() == [0, 4, 8] and recorded["rewards"].tolist() == first["rewards"]

    def bad_expert(task_name, seed):
        return np.zeros((5, 7), np.float32)
    monkeypatch.setitem(sys.modules, "data.aloha_expert", types.SimpleNamespace(expert_trajectory=bad_expert))
    with pytest.raises(SystemExit, match=r"expert_trajectory\('transfer_cube', 1000000\) returned shape \[5, 7\]; "
                                         r"expected \[T, 14\]"):
        rollout("--task", "transfer_cube", "--policy", uri, "--episodes", 1, "--steps", 3, "--workers", 1,
                "--videos", 0, "--baselines", "expert", "--out", tmp_path / "bad")
    no_leftovers(tmp_path, tmp_path / "bad")
    monkeypatch.setitem(sys.modules, "data.aloha_expert", None)  # a checkout without the expert
    with pytest.raises(SystemExit, match=r"the expert baseline needs data.aloha_expert .*--baselines hold"):
        rollout("--task", "transfer_cube", "--policy", uri, "--episodes", 1, "--steps", 3, "--workers", 1,
                "--videos", 0, "--baselines", "expert", "--out", tmp_path / "bad")
    no_leftovers(tmp_path, tmp_path / "bad")


def test_bad_input_gets_one_message_and_leaves_nothing(constant_server, tmp_path, monkeypatch):
    uri, _ = constant_server("pusht", PUSHT_ACTION, 8, (96, 96))
    out = tmp_path / "out"
    common = ["--episodes", 2, "--workers", 1, "--out", out]
    cases = [
        (["--task", "fold_towel"], r"unknown task 'fold_towel'; known tasks: insertion, pusht, transfer_cube"),
        (["--task", "pusht", "--seed", 5], r"evaluation seeds must lie in \[1000000, 2000000\); got \[5, 6\]"),
        (["--task", "pusht", "--replan", 9], r"--replan must lie in \[1, 8\] \(the server's action chunk\), got 9"),
        (["--task", "pusht", "--steps", 301], r"--steps must lie in \[1, 300\]"),
        (["--task", "pusht", "--record", -1], r"--record must be >= 0, got -1"),
        (["--task", "pusht", "--policy", f"ws://127.0.0.1:{free_port()}"],
         r"cannot connect to the policy server at ws://127.0.0.1:\d+ \(ConnectionRefusedError"),
        (["--task", "pusht", "--checkpoint", tmp_path / "nowhere"], r"--checkpoint '\S+nowhere' is not a folder"),
        (["--task", "pusht", "--baselines", "expert"],
         r"the expert baseline replays data.aloha_expert, ALOHA tasks only; task .pusht. has none"),
        (["--task", "transfer_cube", "--baselines", "hold"],
         r"the policy at ws://\S+ \(constant-policy\) outputs 2-D actions \(action_shape \[8, 2\]\), but task "
         r"'transfer_cube' \(gym_aloha/AlohaTransferCube-v0\) takes 14-D"),
    ]
    for args, message in cases:
        policy = [] if {"--policy", "--checkpoint"} & set(args) else ["--policy", uri]
        with pytest.raises(SystemExit, match="rollout failed: " + message):
            rollout(*args, *policy, *common)
        no_leftovers(tmp_path, out)

    # a server asking for two cameras, or a state the task does not have: both sides named
    two = {"cam_high": {"shape": [96, 96, 3], "dtype": "uint8"}, "cam_low": {"shape": [96, 96, 3], "dtype": "uint8"},
           "prompt": {"shape": [], "dtype": "str"}}
    uri2, _ = constant_server("pusht", PUSHT_ACTION, 8, (96, 96), keys=two)
    with pytest.raises(SystemExit, match=r"asks for 2 camera\(s\) \['cam_high', 'cam_low'\].*task 'pusht' provides "
                                         r"one camera 'observation.image', the state 'observation.state' \[2\]"):
        rollout("--task", "pusht", "--policy", uri2, *common)
    wide = {"img": {"shape": [96, 96, 3], "dtype": "uint8"}, "joints": {"shape": [14], "dtype": "float32"}}
    uri3, _ = constant_server("pusht", PUSHT_ACTION, 8, (96, 96), keys=wide)
    with pytest.raises(SystemExit, match=r"asks for the state 'joints' of shape \[14\]; task 'pusht' provides"):
        rollout("--task", "pusht", "--policy", uri3, *common)
    no_leftovers(tmp_path, out)

    monkeypatch.setitem(sys.modules, "gym_pusht", None)  # as if gym-pusht were not installed
    with pytest.raises(SystemExit, match=r"needs the package gym-pusht==0\.1\.8.*pip install gym-pusht==0\.1\.8"):
        rollout("--task", "pusht", "--policy", uri, *common)
    no_leftovers(tmp_path, out)

    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit, match=f"--out '{out}' exists and is not an empty folder"):
        rollout("--task", "pusht", "--policy", uri, *common)
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"

    # as a user runs it: the message alone on stderr, no traceback, a non-zero exit
    got = subprocess.run([sys.executable, "-m", "inference.rollout", "--task", "fold_towel", "--policy", uri,
                          "--episodes", "1", "--out", str(tmp_path / "cli")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 1 and "Traceback" not in got.stderr, got.stderr
    assert got.stderr.strip().endswith("rollout failed: unknown task 'fold_towel'; known tasks: insertion, pusht, "
                                       "transfer_cube")


def untrained_export(folder, dim, action_mean, action_std, init_std=None):
    """An untrained export of the tiny architecture with `dim`-D actions and state (the checkpoint
    contract, not a skill), in `folder`. Its actions are action_mean + action_std x the model's output;
    init_std: every weight drawn from N(0, init_std) (None: the architecture's own init, whose zero
    output layer makes the chunk one fixed draw of noise, whatever the observation). The frozen parts
    are the ones a first tiny training run builds."""
    import torch

    from models.folder import model_spec_from_config
    from models.serialization import save_state
    from models.world_model import WorldModel
    from recipe.config import load_config
    from train.train import make_generated_inputs

    paths = [f"dataset.dataset_dir={ROOT}/assets/synthetic"] + [
        f"model.{k}={ROOT}/assets/tiny/{part}" for k, part in
        (("wan.text_encoder_path", "text_encoder"), ("wan.vae_path", "vae"), ("vlm.checkpoint_path", "vlm"))]
    make_generated_inputs(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), paths))
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), paths + [f"common.action_dim={dim}",
                                                                          f"common.state_dim={dim}"])
    spec = model_spec_from_config(cfg)
    torch.manual_seed(0)
    model = WorldModel(spec)
    if init_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, init_std)
    save_state(spec, model.state_dict(), str(folder))
    stats = {"action": {"mean": list(action_mean), "std": [action_std] * dim},
             "observation.state": {"mean": list(action_mean), "std": [100.0] * dim}}
    (folder / "norm_stats.json").write_text(json.dumps(stats))
    return str(folder)


@pytest.fixture(scope="module")
def aloha_export(tmp_path_factory):
    """14-D, its actions within 0.01 of the start pose: the arms stay put."""
    return untrained_export(tmp_path_factory.mktemp("aloha_export"), 14, aloha_start_pose().tolist(), 0.01)


def children():
    """This process's live children but multiprocessing's resource tracker (it lives as long as we do)."""
    import psutil

    return [p.cmdline() for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != "zombie" and "resource_tracker" not in " ".join(p.cmdline())]


def test_checkpoint_is_served_for_the_rollout_and_stopped(aloha_export, tmp_path):
    from inference.load import config_hash, load_recipe

    # the two workers' queries pair up: a batch closes when both have asked (a hang guard of 10 s each, not a timing)
    overrides = ["serving.batch_window_ms=10000", "serving.max_batch_size=2"]
    out = tmp_path / "report"
    report = rollout("--task", "transfer_cube", "--checkpoint", aloha_export, "--episodes", 2, "--steps", 12,
                     "--replan", 4, "--workers", 2, "--videos", 0, "--baselines", "", "--out", out, *overrides)
    assert children() == []  # the server is stopped
    pol = report["policy"]
    assert pol["checkpoint"] == aloha_export and pol["server_started_by_rollout"]
    assert pol["config_hash"] == config_hash(load_recipe(aloha_export, None, overrides)[0])
    assert pol["weights"] == "raw"  # an export of raw weights, no EMA
    assert report["image_size"] == [64, 64] and report["action_chunk"] == 8 and list(report["results"]) == ["policy"]
    assert report["observation_map"] == {"observation.images.top": "observation/image",
                                         "observation.state": "observation/state", "instruction": "prompt"}
    rows = report["results"]["policy"]["per_episode"]
    assert [r["steps"] for r in rows] == [12, 12] and report["results"]["policy"]["latency_ms"]["queries"] == 6
    log = (out / "server.log").read_text()
    sizes = [int(line.split("batch of ")[1].split(":")[0]) for line in log.splitlines() if "batch of " in line]
    assert sum(sizes) == 6 and max(sizes) == 2, log[-2000:]  # concurrent episodes shared model calls


def test_a_checkpoint_for_another_action_dim_is_refused_naming_both(aloha_export, tmp_path):
    out = tmp_path / "report"
    with pytest.raises(SystemExit, match=rf"the policy for --checkpoint {aloha_export} \({aloha_export}\) outputs "
                                         r"14-D actions \(action_shape \[8, 14\]\), but task 'pusht' "
                                         r"\(gym_pusht/PushT-v0\) takes 2-D actions"):
        rollout("--task", "pusht", "--checkpoint", aloha_export, "--episodes", 1, "--out", out)
    assert children() == []
    no_leftovers(tmp_path, out)


def test_ctrl_c_stops_the_server_and_the_workers_and_writes_nothing(aloha_export, tmp_path):
    """Ctrl-C once both workers have connected to the server (its log in the run's partial folder says so).
    The server answers a batch only when 3 queries are in or after 600 s, so the 2 workers' first queries
    wait there: the interrupt finds them in their episodes, whatever the machine's speed."""
    import glob
    import signal
    import threading
    import time

    import psutil

    out = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "inference.rollout", "--task", "transfer_cube", "--checkpoint",
                             aloha_export, "--episodes", "2", "--workers", "2", "--videos", "0", "--baselines", "",
                             "--out", str(out), "serving.max_batch_size=3", "serving.batch_window_ms=600000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal: a test run started in the background (CI, nohup) ignores
                            # SIGINT, and its children would inherit that and never see the Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()

    def clients():  # the rollout's own metadata query, then one connection per worker
        logs = glob.glob(str(tmp_path / ".report.partial_*" / "server.log"))
        return sum(" connected" in line for line in open(logs[0])) if logs else 0

    deadline = time.monotonic() + 300  # a hang guard: the server loads the model first
    while clients() < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(err)
        time.sleep(0.2)
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any("inference.serve" in " ".join(p.cmdline()) for p in started) and len(started) >= 3
    proc.send_signal(signal.SIGINT)
    assert proc.wait(300) == 1  # a hang guard: stopping the server and 2 workers takes seconds
    time.sleep(0.5)
    assert err[-1].strip() == ("rollout interrupted: the workers and any server this command started are stopped; "
                               "nothing was written"), "".join(err)
    assert not any("Traceback" in line for line in err), "".join(err)
    _, alive = psutil.wait_procs(started, timeout=30)
    assert alive == []
    no_leftovers(tmp_path, out)


@pytest.fixture(scope="module")
def pusht_server(tmp_path_factory):
    """`python -m inference.serve` of an untrained 2-D export whose chunk moves with the picture and the
    state (weights N(0, 0.2): a few pixels between two seeds' first observations) -> its ws:// address."""
    import threading
    import time

    folder = untrained_export(tmp_path_factory.mktemp("pusht_export"), 2, [256.0, 256.0], 60.0, init_std=0.2)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "inference.serve", "--checkpoint", folder, "--host", "127.0.0.1",
                             "--port", str(port), "--steps", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 300  # a hang guard: loading the model
    while not any("serving on ws://" in line for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    yield f"ws://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def external_driver(uri, seeds, steps, instruction):
    """A closed loop written as a user outside this repository writes it: gym-pusht as registered and
    openpi-client, the keys and picture size read from the server's metadata -> rewards per seed."""
    import gymnasium as gym
    import gym_pusht  # noqa: F401  (registers the env)
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    client = WebsocketClientPolicy(uri)
    keys = client.get_server_metadata()["observation_keys"]
    image_key = next(k for k, v in keys.items() if v["dtype"] == "uint8")
    state_key = next(k for k, v in keys.items() if v["dtype"] == "float32")
    prompt_key = next(k for k, v in keys.items() if v["dtype"] == "str")
    height, width, _ = keys[image_key]["shape"]
    env = gym.make("gym_pusht/PushT-v0", obs_type="pixels_agent_pos", observation_height=height,
                   observation_width=width)
    out = {}
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        rewards, done = [], False
        while not done:
            chunk = client.infer({image_key: obs["pixels"], state_key: obs["agent_pos"].astype(np.float32),
                                  prompt_key: instruction})["actions"]
            for action in chunk:
                obs, reward, terminated, _, _ = env.step(action)
                rewards.append(float(reward))
                done = terminated or len(rewards) == steps
                if done:
                    break
        out[seed] = rewards
    return out


def test_an_external_driver_reproduces_the_rollout(pusht_server, tmp_path):
    """How issue 21 is checked: a driver outside the repository, on the served checkpoint, gets the
    rollout's numbers (here step by step, on seeds where the policy's moves change the reward)."""
    from data.sim_env import get_task

    # one worker: its queries reach the model one at a time, as the driver's do (a batch of two rounds
    # its convolutions differently, ~1e-6, and step-by-step equality would then hold only to that)
    report = rollout("--task", "pusht", "--policy", pusht_server, "--episodes", 3, "--seed", PUSHT_SEEDS[0],
                     "--steps", 24, "--workers", 1, "--videos", 0, "--baselines", "hold", "--out", tmp_path / "r")
    theirs = external_driver(pusht_server, PUSHT_SEEDS, 24, get_task("pusht").instruction)
    assert report["image_size"] == [64, 64] and report["replan"] == 8
    policy, hold = report["results"]["policy"]["per_episode"], report["results"]["hold"]["per_episode"]
    for row, held in zip(policy, hold):
        assert len(row["rewards"]) == len(theirs[row["seed"]])
        np.testing.assert_allclose(row["rewards"], theirs[row["seed"]], rtol=1e-12, atol=0)  # see the pusht test
    assert any(abs(max(r["rewards"]) - h["max_reward"]) > 1e-3 for r, h in zip(policy, hold))  # the policy moved
