"""dataset.type synthetic (AV1, pixels move with the actions), robotwin (Motus layout), latent_action."""
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data import DataError, build_datasets, build_train_stream
from data.latent_action import write_latent_episode, write_meta
from data.synthetic import ensure_synthetic, generate, square_size
from utils.video_file import VideoEncoder
from tests.helpers import config_from


def make_cfg(tmp_path, dataset, **common):
    base = {"common": {"action_dim": 4, "state_dim": 4, "num_video_frames": 2, "video_height": 24,
                       "video_width": 32, "global_downsample_rate": 1, "video_action_freq_ratio": 2, **common},
            "dataset": {"val_fraction": 0.0, **dataset}, "training": {"batch_size": 2}, "system": {"num_workers": 0}}
    return config_from(tmp_path, base)


SMALL = {"num_episodes": 3, "episode_length": 16, "fps": 10, "image_height": 24, "image_width": 32, "seed": 9}


def test_synthetic_is_deterministic_and_pixels_follow_actions(tmp_path):
    cfg = make_cfg(tmp_path, {"type": "synthetic", "dataset_dir": str(tmp_path / "syn"), "synthetic": SMALL,
                              "normalization": "none"}, state_dim=8)
    train, _, _ = build_datasets(cfg)  # generates the folder (AV1) on first use
    again = str(tmp_path / "again")
    generate(again, **{**SMALL, "num_squares": 2})
    path = "data/chunk-000/file-000.parquet"
    assert pq.read_table(os.path.join(again, path)).equals(pq.read_table(str(tmp_path / "syn" / path)))
    ep = train.episodes[1]
    position = ep.state[:, :4]  # then the goals
    np.testing.assert_allclose(position[1:], position[:-1] + ep.action[1:], atol=1e-6)  # positions integrate actions
    assert np.abs(ep.action).max() > 0.005
    size = square_size(24, 32)
    video = train.load((1, 5))["video"].numpy()
    for j, frame in enumerate([5, 7, 9]):
        red = (video[j, 0] > 0.5) & (video[j, 1] < -0.3) & (video[j, 2] < -0.3)
        ys, xs = np.nonzero(red)
        x, y = position[frame, 0] * (32 - size), position[frame, 1] * (24 - size)
        assert abs(xs.mean() - (x + size / 2 - 0.5)) < 1.0 and abs(ys.mean() - (y + size / 2 - 0.5)) < 1.0
    ensure_synthetic(cfg)  # present and matching: nothing to do
    from omegaconf import OmegaConf
    with pytest.raises(DataError, match="delete the folder"):
        ensure_synthetic(OmegaConf.merge(cfg, {"dataset": {"synthetic": {"seed": 10}}}))


def write_motus(root, tasks, episodes=2, length=14, dim=4):
    qpos_all = {}
    for split in ("clean", "randomized"):
        for task in tasks:
            folder = os.path.join(root, split, task)
            for sub in ("qpos", "videos", "metas"):
                os.makedirs(os.path.join(folder, sub), exist_ok=True)
            for k in range(episodes):
                qpos = torch.arange(length * dim, dtype=torch.float32).view(length, dim) + 1000 * k
                torch.save(qpos, os.path.join(folder, "qpos", f"{k}.pt"))
                qpos_all[(split, task, k)] = qpos.numpy()
                encoder = VideoEncoder(os.path.join(folder, "videos", f"{k}.mp4"), 10, 32, 24, codec="libx264")
                for t in range(length):
                    encoder.write(np.full((24, 32, 3), 10 * t, np.uint8))
                encoder.close()
                with open(os.path.join(folder, "metas", f"{k}.txt"), "w") as f:
                    f.write(f"{task} first\n{task} second\n")
    return qpos_all


def test_robotwin_motus_layout(tmp_path):
    root = str(tmp_path / "motus")
    qpos = write_motus(root, ["adjust_bottle", "stack_bowls"])
    cfg = make_cfg(tmp_path, {"type": "robotwin", "dataset_dir": root, "normalization": "none",
                              "data_mode": "clean", "task_mode": "single", "task_name": "stack_bowls"})
    train, _, _ = build_datasets(cfg)
    assert train.num_episodes() == 2 and {e.source for e in train.episodes} == {0}
    sample = train.load((1, 3))
    want = qpos[("clean", "stack_bowls", 1)]
    np.testing.assert_array_equal(sample["state"].numpy(), want[3])
    np.testing.assert_array_equal(sample["actions"].numpy(), want[[4, 5, 6, 7]])
    assert sample["instruction"] == "stack_bowls second"  # lines alternate with the condition frame
    grey = (sample["video"].numpy() + 1) * 127.5
    np.testing.assert_allclose(grey[:, :, 12, 16].mean(1), [30, 50, 70], atol=4)
    both = make_cfg(tmp_path, {"type": "robotwin", "dataset_dir": root, "data_mode": "both", "task_mode": "multi"})
    train, _, stats = build_datasets(both)
    assert train.num_episodes() == 8 and train.source_probs.tolist() == [0.5, 0.5]
    assert next(build_train_stream(train, both)).actions.shape == (2, 4, 4)
    with pytest.raises(DataError, match="task 'nope'"):
        build_datasets(make_cfg(tmp_path, {"type": "robotwin", "dataset_dir": root, "task_mode": "single",
                                           "task_name": "nope"}))


def test_latent_action_format(tmp_path):
    source = str(tmp_path / "syn")
    generate(source, **{**SMALL, "num_squares": 2})
    root = str(tmp_path / "latent")
    write_meta(root, fps=10)
    episodes = pq.read_table(os.path.join(source, "meta/episodes/chunk-000/file-000.parquet")).to_pylist()
    video = os.path.join(source, "videos/observation.images.top/chunk-000/file-000.mp4")
    latents = []
    for k, ep in enumerate(episodes):  # all episodes share one mp4: each starts at its from_timestamp
        latents.append(np.random.default_rng(k).normal(size=(16, 4)).astype(np.float32))
        write_latent_episode(root, f"ep{k}", latents[-1], video, instruction=f"latent {k}",
                             video_start=ep["videos/observation.images.top/from_timestamp"])
    cfg = make_cfg(tmp_path, {"type": "latent_action", "dataset_dir": root, "normalization": "none"})
    train, _, stats = build_datasets(cfg)
    sample = train.load((2, 1))
    assert "state" not in sample and sample["instruction"] == "latent 2"
    np.testing.assert_array_equal(sample["actions"].numpy(), latents[2][[2, 3, 4, 5]])
    lerobot = build_datasets(make_cfg(tmp_path, {"type": "lerobot", "dataset_dir": source}, state_dim=8))[0]
    torch.testing.assert_close(sample["video"], lerobot.load((2, 1))["video"])  # same frames through both paths
    batch = next(build_train_stream(train, cfg))
    assert batch.actions.shape == (2, 4, 4) and batch.state is None
    assert json.load(open(os.path.join(root, "meta.json")))["format"] == "latent_action"
