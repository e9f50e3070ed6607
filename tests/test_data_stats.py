"""Normalisation statistics against a direct numpy computation; the four modes; round trips."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data import NormStats, build_datasets
from data.normalize import compute_feature_stats
from data.synthetic import generate
from tests.helpers import config_from

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("stats") / "ds")
    generate(out, num_episodes=4, episode_length=25, fps=10, image_height=16, image_width=16, seed=2,
             codec="libx264", episodes_per_file=3)
    return out


def direct(root, key):
    """The column straight from every parquet file, without our reader."""
    tables = [pq.read_table(p, columns=[key]) for p in sorted(glob.glob(os.path.join(root, "data", "*", "*.parquet")))]
    return np.concatenate([np.stack(t.column(key).to_pylist()) for t in tables]).astype(np.float64)


def test_cli_matches_numpy(root, tmp_path):
    out = tmp_path / "stats.json"
    subprocess.run([sys.executable, "-m", "data.compute_stats", root, "--out", str(out)], cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    stats = json.loads(out.read_text())
    assert set(stats) == {"action", "observation.state"}
    for key in stats:
        x = direct(root, key)
        want = {"mean": x.mean(0), "std": x.std(0, ddof=0), "min": x.min(0), "max": x.max(0),
                "q01": np.quantile(x, 0.01, axis=0), "q99": np.quantile(x, 0.99, axis=0)}
        for name, value in want.items():
            np.testing.assert_allclose(stats[key][name], value, rtol=1e-6, atol=1e-9, err_msg=f"{key}.{name}")
        assert stats[key]["count"] == [100]


def test_modes_and_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(3.0, 2.0, (500, 2)), np.full((500, 1), 7.0)], axis=1)  # last dim constant
    raw = {"action": compute_feature_stats(x)}
    xs = x.astype(np.float32)
    mean_std = NormStats(raw, "mean_std")
    y = mean_std.normalize_action(xs)
    np.testing.assert_allclose(y[:, :2].mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(y[:, :2].std(0), 1, atol=1e-5)
    np.testing.assert_allclose(y[:, 2], 0)  # constant dimension: shifted, not divided by ~0
    min_max = NormStats(raw, "min_max").normalize_action(xs)
    np.testing.assert_allclose(min_max[:, :2].min(0), -1, atol=1e-6)
    np.testing.assert_allclose(min_max[:, :2].max(0), 1, atol=1e-6)
    quantile = NormStats(raw, "quantile")
    q = quantile.normalize_action(np.array(raw["action"]["q01"], np.float32))
    np.testing.assert_allclose(q[:2], -1, atol=1e-6)
    np.testing.assert_array_equal(NormStats({}, "none").normalize_action(xs), xs)
    for stats in (mean_std, quantile):
        np.testing.assert_allclose(stats.unnormalize_action(stats.normalize_action(xs)), xs, rtol=1e-5, atol=1e-5)
    import torch
    t = torch.from_numpy(xs)
    assert torch.allclose(mean_std.unnormalize_action(mean_std.normalize_action(t)), t, atol=1e-5)
    path = tmp_path / "norm.json"
    quantile.save(path)
    loaded = NormStats.load(path)
    assert loaded.mode == "quantile" and loaded.to_dict() == quantile.to_dict()
    assert NormStats.from_dict(quantile.to_dict(), mode="min_max").mode == "min_max"
    with pytest.raises(ValueError, match="dimension 2"):
        mean_std.normalize_action(np.zeros((1, 2), np.float32))


def make_cfg(tmp_path, root, **dataset):
    base = {"common": {"action_dim": 4, "state_dim": 8, "num_video_frames": 2, "video_height": 16, "video_width": 16,
                       "global_downsample_rate": 1, "video_action_freq_ratio": 2},
            "dataset": {"type": "lerobot", "dataset_dir": root, "val_fraction": 0.25, **dataset},
            "training": {"batch_size": 2}, "system": {"num_workers": 0}}
    return config_from(tmp_path, base)


def test_dataset_normalises_with_its_statistics(root, tmp_path):
    train, _, stats = build_datasets(make_cfg(tmp_path, root))  # computed at start: every episode, parquet only
    x = direct(root, "action")
    np.testing.assert_allclose(stats.stats["action"]["mean"], x.mean(0), rtol=1e-6, atol=1e-9)
    sample, ep = train.load((1, 3)), train.episodes[1]
    want = (ep.action[[4, 5, 6, 7]] - x.mean(0)) / x.std(0)
    np.testing.assert_allclose(sample["actions"].numpy(), want, rtol=1e-4, atol=1e-5)
    s = direct(root, "observation.state")
    np.testing.assert_allclose(sample["state"].numpy(), (ep.state[3] - s.mean(0)) / s.std(0), rtol=1e-4, atol=1e-5)
    # a stats file is used as given, with the configured mode
    path = tmp_path / "given.json"
    fake = {k: {"mean": [1.0] * n, "std": [2.0] * n, "min": [0.0] * n, "max": [4.0] * n, "q01": [0.0] * n,
                "q99": [2.0] * n, "count": [1]} for k, n in (("action", 4), ("observation.state", 8))}
    path.write_text(json.dumps(fake))
    train, _, stats = build_datasets(make_cfg(tmp_path, root, stats_path=str(path), normalization="min_max"))
    np.testing.assert_allclose(train.load((1, 3))["actions"].numpy(), (ep.action[[4, 5, 6, 7]] - 2.0) / 2.0,
                               rtol=1e-5, atol=1e-6)
    assert stats.to_dict()["normalization"]["mode"] == "min_max"


def test_relative_action_dims_are_distances_from_the_condition_state(root, tmp_path):
    """dataset.relative_action_dims: those dims learned as (action - state) / std, the state of the condition
    frame; the others absolute; unnormalize adds the state back; the checkpoint's statistics carry the dims."""
    import torch

    train, _, stats = build_datasets(make_cfg(tmp_path, root, relative_action_dims=[0, 2]))
    x, s = direct(root, "action"), direct(root, "observation.state")
    sample, ep = train.load((1, 3)), train.episodes[1]
    actions = ep.action[[4, 5, 6, 7]]
    want = (actions - x.mean(0)) / x.std(0)
    want[:, [0, 2]] = (actions[:, [0, 2]] - ep.state[3][[0, 2]]) / x.std(0)[[0, 2]]
    np.testing.assert_allclose(sample["actions"].numpy(), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sample["state"].numpy(), (ep.state[3] - s.mean(0)) / s.std(0), rtol=1e-4, atol=1e-5)
    back = stats.unnormalize_action(sample["actions"][None], sample["state"][None])  # a batch, as inference has it
    assert isinstance(back, torch.Tensor)
    np.testing.assert_allclose(back[0].numpy(), actions, rtol=1e-5, atol=1e-5)
    assert NormStats.from_dict(stats.to_dict()).relative_dims == [0, 2]
    older = stats.to_dict()
    del older["normalization"]["relative_action_dims"]  # statistics saved before the key existed: absolute
    assert NormStats.from_dict(older).relative_dims == []
    with pytest.raises(ValueError, match=r"relative to the state \(dims \[0, 2\]\) need the state"):
        stats.normalize_action(actions)


def test_relative_action_horizon_fades_the_state_into_the_mean(root, tmp_path):
    """dataset.relative_action_horizon k: action i of the chunk is learned as (a_i - w_i s - (1 - w_i) mean) / std
    with w_i = max(0, 1 - i / k): the first action relative, from the k-th on absolute; unnormalize inverts
    it for a batch, and the checkpoint's statistics carry the horizon."""
    train, _, stats = build_datasets(make_cfg(tmp_path, root, relative_action_dims=[0, 2], relative_action_horizon=2))
    x = direct(root, "action")
    sample, ep = train.load((1, 3)), train.episodes[1]
    actions = ep.action[[4, 5, 6, 7]]
    want = (actions - x.mean(0)) / x.std(0)
    for i, w in enumerate([1.0, 0.5, 0.0, 0.0]):
        origin = w * ep.state[3][[0, 2]] + (1 - w) * x.mean(0)[[0, 2]]
        want[i, [0, 2]] = (actions[i, [0, 2]] - origin) / x.std(0)[[0, 2]]
    np.testing.assert_allclose(sample["actions"].numpy(), want, rtol=1e-4, atol=1e-5)
    back = stats.unnormalize_action(sample["actions"][None], sample["state"][None])
    np.testing.assert_allclose(back[0].numpy(), actions, rtol=1e-5, atol=1e-5)
    again = NormStats.from_dict(stats.to_dict())
    assert (again.relative_dims, again.relative_horizon) == ([0, 2], 2)
    np.testing.assert_array_equal(again.normalize_action(actions, sample["state"].numpy()), sample["actions"].numpy())
    # the fade is kept per chunk length, dtype and device: a shorter float64 tensor chunk after the numpy one
    short = again.normalize_action(torch.as_tensor(actions[:3], dtype=torch.float64), sample["state"].double())
    assert short.dtype == torch.float64
    np.testing.assert_allclose(short.numpy(), want[:3], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="relative action horizon 0: expected a positive number"):
        NormStats(stats.stats, relative_dims=[0], relative_horizon=0)
