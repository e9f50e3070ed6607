"""data/aloha_expert.py and data/sim_demos.py: the scripted expert solves transfer_cube in the joint-space
env (as gym.make builds it) well inside the 300-step cap, and `python -m data.sim_demos` writes a LeRobot
v3.0 folder our reader loads with the replayed values and the rendered frames."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data import build_datasets
from data.aloha_expert import expert_trajectory, handover_step
from data.sim_env import SimTaskError, TASKS, make_env
from tests.helpers import ROOT, config_from

H, W = 48, 64   # written at the size the reader is asked for: decoded frames are compared unresampled
SEEDS = (0, 1, 2, 3, 4)


def replay(seed, actions, render_at=()):
    """(step that solved the task or -1, state before each step, {step: frame rendered before it},
    reward of each step)."""
    env = make_env("transfer_cube", (H, W))
    env.reset(seed)
    states, frames, rewards, solved = [], {}, [], -1
    for t, action in enumerate(actions):
        states.append(env.state())
        if t in render_at:
            frames[t] = env.render()
        reward, success = env.step(action)
        rewards.append(reward)
        if success and solved < 0:
            solved = t
    return solved, np.asarray(states), frames, rewards


@pytest.mark.parametrize("seed", SEEDS)
def test_expert_solves_in_the_joint_env_within_the_cap(seed):
    actions = expert_trajectory("transfer_cube", seed)
    assert actions.dtype == np.float32 and actions.shape[1] == 14 and len(actions) <= TASKS["transfer_cube"].max_steps
    solved, _, _, rewards = replay(seed, actions)
    assert 0 <= solved < 250, solved  # the registered env truncates at 300 steps
    # seed 2's cube slips out of the right gripper, and the left one lifts it off the table alone
    assert (handover_step(rewards) == solved) == (seed != 2)
    np.testing.assert_array_equal(expert_trajectory("transfer_cube", seed), actions)  # a function of the seed


@pytest.mark.parametrize("seed", SEEDS)
def test_handover_only_expert_hands_the_cube_over(seed):
    actions = expert_trajectory("transfer_cube", seed, "handover_only")
    assert actions.dtype == np.float32 and len(actions) <= TASKS["transfer_cube"].max_steps
    solved, _, _, rewards = replay(seed, actions)
    assert 0 <= solved < 250, solved
    held = rewards.index(2.0)  # the right gripper holds the cube off the table ...
    assert held < solved and max(rewards[:held]) < 2 and handover_step(rewards) == solved  # ... before the left takes it


def test_prefer_handover_keeps_the_default_grasp_where_it_hands_over():
    # seed 0: the default -x grasp hands over at its first depth, so the trajectory is the default's;
    # seed 2: no -x depth hands over (the default's success is the left gripper alone), the pointed grasp does
    np.testing.assert_array_equal(expert_trajectory("transfer_cube", 0, "prefer_handover"),
                                  expert_trajectory("transfer_cube", 0))
    actions = expert_trajectory("transfer_cube", 2, "prefer_handover")
    np.testing.assert_array_equal(actions, expert_trajectory("transfer_cube", 2, "handover_only"))
    solved, _, _, rewards = replay(2, actions)
    assert handover_step(rewards) == solved >= 0
    with pytest.raises(SimTaskError, match="style 'both'; expected one of default, handover_only, prefer_handover"):
        expert_trajectory("transfer_cube", 0, "both")


def test_a_cube_the_left_gripper_lifts_off_the_table_is_no_handover():
    assert handover_step([0, 1, 2, 2, 3, 4, 4]) == 5
    assert handover_step([0, 0, 0, 3, 4]) == -1    # never held by the right gripper
    assert handover_step([0, 1, 2, 1, 0, 3]) == -1  # held, dropped, never solved
    assert handover_step([]) == -1


def test_expert_scenes_differ_by_seed_and_unknown_tasks_are_named():
    a, b = expert_trajectory("transfer_cube", 0), expert_trajectory("transfer_cube", 1)
    assert np.abs(a[:80] - b[:80]).max() > 0.05  # the cube is elsewhere: the reach differs
    with pytest.raises(SimTaskError, match="no scripted expert for task 'insertion'.*transfer_cube"):
        expert_trajectory("insertion", 0)
    with pytest.raises(SimTaskError, match="unknown task 'fold'"):
        expert_trajectory("fold", 0)


def run_demos(*args):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "data.sim_demos", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def read_demos(tmp_path, out):
    """The training set our reader makes of the folder `out`, unnormalised."""
    cfg = config_from(tmp_path, {
        "common": {"action_dim": 14, "state_dim": 14, "num_video_frames": 2, "video_height": H, "video_width": W,
                   "global_downsample_rate": 8, "video_action_freq_ratio": 2},
        "dataset": {"type": "lerobot", "dataset_dir": str(out), "val_fraction": 0.0, "normalization": "none"},
        "training": {"batch_size": 2, "seed": 0}, "system": {"num_workers": 0}})
    return build_datasets(cfg)[0]


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos") / "aloha"
    result = run_demos("--task", "transfer_cube", "--episodes", "2", "--out", str(out), "--seed", "3",
                       "--image-size", str(H), str(W), "--workers", "2", "--tail", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result.stdout


def test_written_folder_loads_with_the_replayed_values_and_frames(demos, tmp_path):
    out, log = demos
    assert "seed       3  success True" in log and "expert success 2/2 = 100.0%" in log
    info = json.load(open(out / "meta" / "info.json"))
    assert info["codebase_version"] == "v3.0" and info["fps"] == 50 and info["total_episodes"] == 2
    assert info["features"]["observation.images.top"]["shape"] == [H, W, 3]
    provenance = json.load(open(out / "meta" / "sim_demos.json"))
    assert provenance == {"task": "transfer_cube", "seeds": [3, 4], "image_size": [H, W], "tail": 4,
                          "expert_style": "default", "action_noise": 0.0, "noise_draws": None}
    train = read_demos(tmp_path, out)
    assert train.num_episodes() == 2 and train.image_keys == ["observation.images.top"]
    for i, seed in enumerate((3, 4)):
        actions = expert_trajectory("transfer_cube", seed)
        solved, _, _, _ = replay(seed, actions)
        ep = train.episodes[i]
        assert ep.length == solved + 1 + 4  # up to the solving step, then --tail 4
        last = ep.length - 1 - train.spec.span
        windows = (0, last // 2, last)
        wanted = sorted({int(k) for c in windows for k in train.spec.video_indices(c)})
        _, states, frames, _ = replay(seed, actions[:ep.length], render_at=wanted)
        for c in windows:
            sample = train.load((i, c))
            assert sample["instruction"] == TASKS["transfer_cube"].instruction
            np.testing.assert_array_equal(sample["state"].numpy(), states[c])  # float32 as replayed, bit for bit
            np.testing.assert_array_equal(sample["actions"].numpy(), actions[train.spec.action_indices(c)])
            video = sample["video"].numpy()
            for j, k in enumerate(train.spec.video_indices(c)):
                want = frames[int(k)].astype(np.float32).transpose(2, 0, 1) / 127.5 - 1
                err = np.abs(video[j] - want)
                # AV1 at crf 30 is lossy: mean error under 3% of the range, as tests/test_data_lerobot.py allows
                assert err.mean() < 0.03, (seed, c, k, err.mean())


def test_arm_noise_is_a_slow_offset_of_the_given_spread_on_the_arms_only():
    from data.sim_demos import NOISE_STEPS, arm_noise

    offset = arm_noise(7, 0, 200_000, 0.02)
    assert offset.shape == (200_000, 14) and not offset[:, [6, 13]].any()  # the grippers' commands untouched
    arms = offset[:, [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]]
    assert np.allclose(arms.std(axis=0), 0.02, rtol=0.05)  # stationary from the first step
    lagged = (arms[NOISE_STEPS:] * arms[:-NOISE_STEPS]).mean() / arms.var()
    assert abs(lagged - np.exp(-1)) < 0.03  # correlated over NOISE_STEPS steps
    np.testing.assert_array_equal(arm_noise(7, 0, 300, 0.02), offset[:300])  # a seed and draw give one offset
    assert not np.allclose(arm_noise(7, 1, 300, 0.02), offset[:300])


def test_action_noise_records_the_expert_at_the_perturbed_states(tmp_path):
    from benchmarks.handover import demo_rewards
    from data.sim_demos import executed_actions

    out = tmp_path / "noisy"
    result = run_demos("--task", "transfer_cube", "--episodes", "1", "--out", str(out), "--seed", "3",
                       "--image-size", str(H), str(W), "--workers", "1", "--tail", "4", "--action-noise", "0.02")
    assert result.returncode == 0, result.stdout + result.stderr
    provenance = json.load(open(out / "meta" / "sim_demos.json"))
    assert provenance["action_noise"] == 0.02 and provenance["seeds"] == [3]
    (draw,) = provenance["noise_draws"]
    train = read_demos(tmp_path, out)
    actions = expert_trajectory("transfer_cube", 3)
    executed = executed_actions(actions, 3, 0.02, draw)
    solved, states, _, _ = replay(3, executed)
    _, clean_states, _, _ = replay(3, actions)
    ep = train.episodes[0]
    assert ep.length == solved + 1 + 4
    for c in (0, (ep.length - 1 - train.spec.span) // 2):
        sample = train.load((0, c))
        np.testing.assert_array_equal(sample["state"].numpy(), states[c])  # the perturbed arm's state ...
        np.testing.assert_array_equal(sample["actions"].numpy(), actions[train.spec.action_indices(c)])  # ... the plan
    assert np.abs(states[:ep.length] - clean_states[:ep.length]).max() > 0.01  # the noise moved the arm
    (rewards,) = demo_rewards(str(out))  # benchmarks/handover.py replays the execution, not the labels
    assert len(rewards) == solved + 1 and rewards[-1] == 4.0


@pytest.mark.parametrize("case", ["unknown_task", "no_expert", "existing_out", "eval_seed", "negative_noise"])
def test_bad_input_one_message_nothing_left(tmp_path, case):
    out = tmp_path / "out"
    args = {"unknown_task": ["--task", "fold_towel"], "no_expert": ["--task", "insertion"],
            "existing_out": ["--task", "transfer_cube"], "eval_seed": ["--task", "transfer_cube", "--seed", "1000000"],
            "negative_noise": ["--task", "transfer_cube", "--action-noise", "-0.01"]}
    if case == "existing_out":
        out.mkdir()
        (out / "mine.txt").write_text("keep")
    result = run_demos(*args[case], "--episodes", "2", "--out", str(out), "--workers", "1")
    message = {"unknown_task": "unknown task 'fold_towel'; known tasks: insertion, pusht, transfer_cube",
               "no_expert": "no scripted expert for task 'insertion'; experts exist for: transfer_cube",
               "existing_out": f"--out {out} already exists and is not an empty folder",
               "eval_seed": r"demonstration seeds must lie in [0, 1000000); got [1000000, 1000003]",
               "negative_noise": "--action-noise (-0.01) in [0, 1) radians"}[case]
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == (["out"] if case == "existing_out" else [])
    if case == "existing_out":
        assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"


def test_aloha_recipe_loads_and_matches_the_simulator_and_the_demos():
    from recipe.config import load_config

    from data.sim_demos import DEFAULT_IMAGE_SIZE
    cfg, task = load_config("configs/aloha_sim.yaml"), TASKS["transfer_cube"]
    c = cfg.common
    assert (c.action_dim, c.state_dim) == (task.action_dim, task.state_dim)
    # one action per simulator step: inference.rollout executes a chunk's actions one step each
    assert c.global_downsample_rate == 1 and c.action_chunk_size == 32
    assert (c.video_height, c.video_width) == DEFAULT_IMAGE_SIZE  # frames read as rendered, not resampled
    assert cfg.dataset.type == "lerobot" and cfg.dataset.image_keys == [task.image_key]
    assert (cfg.dataset.state_key, cfg.dataset.action_key) == (task.state_key, "action")
    assert cfg.serving.image_keys == [task.image_key] and cfg.serving.state_key == task.state_key
    assert cfg.serving.image_shape == [c.video_height, c.video_width, 3]
    assert cfg.model.size == "tiny" and cfg.model.wan.vae_path == "assets/tiny_aloha/vae"  # not the squares' VAE
    # actions relative to the state only where both name the same arm joint; a gripper's action is a command
    from gym_aloha.constants import JOINTS
    arms = [i for i, name in enumerate(JOINTS) if not name.endswith("_gripper")]
    assert cfg.dataset.relative_action_dims == arms and len(arms) == 12
    assert 0 < cfg.dataset.relative_action_horizon < c.action_chunk_size
