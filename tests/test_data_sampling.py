"""Windows at episode boundaries, resize/padding, stream resume and sharding, validation split."""
import numpy as np
import pytest
import torch

from data import DataError, build_datasets, build_train_stream, build_val_loader
from data.episodes import WindowSpec, split_episodes
from data.synthetic import generate
from data.transforms import fit_frames, tile_cameras
from tests.helpers import config_from


def make_cfg(tmp_path, root, **dataset):
    base = {"common": {"action_dim": 4, "state_dim": 8, "num_video_frames": 2, "video_height": 16,
                       "video_width": 24, "global_downsample_rate": 2, "video_action_freq_ratio": 2},
            "dataset": {"type": "lerobot", "dataset_dir": root, **dataset},
            "training": {"batch_size": 2, "seed": 7}, "system": {"num_workers": 0, "pin_memory": False}}
    return config_from(tmp_path, base)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sampling") / "ds")
    # lengths are all 20; window span is 2 * 2 * 2 = 8, so 12 condition frames per episode
    generate(out, num_episodes=6, episode_length=20, fps=10, image_height=16, image_width=24, seed=1,
             codec="libx264")
    return out


def test_window_indices():
    spec = WindowSpec(num_video_frames=3, downsample=2, ratio=2)
    assert spec.span == 12
    assert spec.num_windows(12) == 0 and spec.num_windows(13) == 1 and spec.num_windows(20) == 8
    c = spec.num_windows(20) - 1  # the last condition frame of a 20-frame episode
    assert spec.action_indices(c).tolist() == [9, 11, 13, 15, 17, 19]
    assert spec.video_indices(c).tolist() == [7, 11, 15, 19]
    assert spec.video_indices(0).tolist() == [0, 4, 8, 12]  # frame j lines up with the last action of its slice
    assert spec.action_indices(0)[1::2].tolist() == spec.video_indices(0)[1:].tolist()


def test_draws_never_pass_episode_end(root, tmp_path):
    train, _, _ = build_datasets(make_cfg(tmp_path, root, val_fraction=0.0))
    seen = set()
    for n in range(600):
        i, c = train.draw(np.random.default_rng(n))
        assert 0 <= c <= 11
        assert train.spec.video_indices(c)[-1] <= train.episodes[i].length - 1
        seen.add(c)
    assert seen == set(range(12))  # both ends are reached


def test_short_episodes_are_left_out(root, tmp_path):
    cfg = make_cfg(tmp_path, root, val_fraction=0.0)
    from omegaconf import OmegaConf
    cfg = OmegaConf.merge(cfg, {"common": {"num_video_frames": 5}})  # span 20 > 19: no window fits
    with pytest.raises(DataError, match=r"^no training episode has the 21 frames one window needs$"):
        build_datasets(cfg)


def test_fit_and_tile():
    frames = np.zeros((1, 10, 20, 3), np.uint8)
    frames[..., 1] = 255
    out = fit_frames(frames, 20, 20).numpy()  # 10 x 20 -> 10 x 20 centred in 20 x 20
    assert out.shape == (1, 3, 20, 20)
    np.testing.assert_allclose(out[0, :, :5], -1.0)
    np.testing.assert_allclose(out[0, :, 15:], -1.0)
    np.testing.assert_allclose(out[0, 1, 5:15], 1.0)
    np.testing.assert_allclose(out[0, 0, 5:15], -1.0)
    small = fit_frames(np.full((2, 40, 40, 3), 255, np.uint8), 8, 16).numpy()  # shrink to 8 x 8, bars left/right
    np.testing.assert_allclose(small[:, :, :, 4:12], 1.0, atol=1e-6)
    np.testing.assert_allclose(small[:, :, :, :4], -1.0)
    tiled = tile_cameras([np.ones((1, 4, 4, 3), np.uint8), np.full((1, 2, 6, 3), 9, np.uint8)])
    assert tiled.shape == (1, 4, 10, 3) and tiled[0, 3, 9, 0] == 0 and tiled[0, 1, 9, 0] == 9


def _take(stream, n):
    return [next(stream) for _ in range(n)]


def _same(a, b):
    assert a.episode_index.tolist() == b.episode_index.tolist()
    assert a.frame_index.tolist() == b.frame_index.tolist()
    assert torch.equal(a.video, b.video) and torch.equal(a.actions, b.actions)


def test_stream_resume_is_exact(root, tmp_path):
    cfg = make_cfg(tmp_path, root)
    train, _, _ = build_datasets(cfg)
    reference = _take(build_train_stream(train, cfg), 5)
    # workers prefetch ahead; the state still counts only the batches the caller took
    from omegaconf import OmegaConf
    cfg_w = OmegaConf.merge(cfg, {"system": {"num_workers": 2}})
    stream = build_train_stream(train, cfg_w)
    first = _take(stream, 2)
    state = stream.state_dict()
    assert state["batches_consumed"] == 2
    resumed = build_train_stream(train, cfg)
    resumed.load_state_dict(state)
    for a, b in zip(first + _take(resumed, 3), reference):
        _same(a, b)
    stream.close()


def test_ranks_get_different_deterministic_batches(root, tmp_path):
    cfg = make_cfg(tmp_path, root)
    train, _, _ = build_datasets(cfg)
    r0, r1 = _take(build_train_stream(train, cfg, 0, 2), 3), _take(build_train_stream(train, cfg, 1, 2), 3)
    again = _take(build_train_stream(train, cfg, 1, 2), 3)
    for a, b in zip(r1, again):
        _same(a, b)
    pairs0 = {(e, f) for b in r0 for e, f in zip(b.episode_index.tolist(), b.frame_index.tolist())}
    pairs1 = {(e, f) for b in r1 for e, f in zip(b.episode_index.tolist(), b.frame_index.tolist())}
    assert pairs0 != pairs1


def test_validation_is_held_out_finite_and_sharded(root, tmp_path):
    assert split_episodes(range(10), None, 0.2) == (list(range(8)), [8, 9])
    assert split_episodes(range(4), [0, 2], 0.5) == ([1, 3], [0, 2])
    cfg = make_cfg(tmp_path, root, val_episodes=[1, 4])
    train, val, _ = build_datasets(cfg)
    assert sorted(e.index for e in train.episodes) == [0, 2, 3, 5]
    assert sorted(e.index for e in val.episodes) == [1, 4]
    for batch in _take(build_train_stream(train, cfg), 10):
        assert not set(batch.episode_index.tolist()) & {1, 4}
    loaders = [build_val_loader(val, cfg, r, 2) for r in range(2)]
    batches = [list(loader) for loader in loaders]
    # 2 episodes x 2 non-overlapping windows (c = 0, 8) = 4 windows, 2 per rank, one batch each
    assert [len(b) for b in batches] == [1, 1] and [len(loader) for loader in loaders] == [1, 1]
    seen = sorted((e, f) for bs in batches for b in bs
                  for e, f in zip(b.episode_index.tolist(), b.frame_index.tolist()))
    assert seen == [(1, 0), (1, 8), (4, 0), (4, 8)]
    again = list(build_val_loader(val, cfg, 0, 2))
    _same(again[0], batches[0][0])
    default = make_cfg(tmp_path, root, val_fraction=0.34)
    assert sorted(e.index for e in build_datasets(default)[1].episodes) == [4, 5]


def test_validation_workers_are_forked_once_and_serve_every_validation(root, tmp_path, monkeypatch):
    """With workers, every validation after the first reuses the first one's processes (no fork per
    validation) and yields the same batches, also after a validation that stopped early."""
    from omegaconf import OmegaConf
    from torch.utils.data import dataloader

    cfg = make_cfg(tmp_path, root, val_episodes=[1, 4])
    _, val, _ = build_datasets(cfg)
    starts = []
    real = dataloader._MultiProcessingDataLoaderIter.__init__

    def counted(self, loader):
        starts.append(loader)
        real(self, loader)
    monkeypatch.setattr(dataloader._MultiProcessingDataLoaderIter, "__init__", counted)
    reference = list(build_val_loader(val, cfg, 0, 1))  # no workers: no process started
    assert starts == [] and len(reference) == 2
    loader = build_val_loader(val, OmegaConf.merge(cfg, {"system": {"num_workers": 1}}), 0, 1)
    for _ in range(3):
        next(iter(loader))  # a validation that stops after one batch (system.val_batches)
        got = list(loader)
        for a, b in zip(got, reference):
            _same(a, b)
        assert len(got) == 2
    assert len(starts) == 1
