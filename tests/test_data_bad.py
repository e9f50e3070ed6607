"""Bad data: a clear DataError naming file and episode, or (skip_bad_samples) skipped, counted, reported."""
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import DataError, build_datasets, build_train_stream
from tests.helpers import config_from

EP1_DATA = "data/chunk-000/episode_000001.parquet"
EP1_VIDEO = "videos/chunk-000/observation.images.top/episode_000001.mp4"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    from data.synthetic import generate
    out = str(tmp_path_factory.mktemp("bad") / "ds")
    generate(out, num_episodes=4, episode_length=16, fps=10, image_height=16, image_width=16, seed=4,
             codec="libx264", version="v2.1")
    return out


@pytest.fixture
def root(pristine, tmp_path):
    out = str(tmp_path / "ds")
    shutil.copytree(pristine, out)
    return out


def make_cfg(tmp_path, root, skip=False, **common):
    base = {"common": {"action_dim": 4, "state_dim": 8, "num_video_frames": 2, "video_height": 16,
                       "video_width": 16, "global_downsample_rate": 1, "video_action_freq_ratio": 2, **common},
            "dataset": {"type": "lerobot", "dataset_dir": root, "val_fraction": 0.0, "skip_bad_samples": skip},
            "training": {"batch_size": 4}, "system": {"num_workers": 0}}
    return config_from(tmp_path, base)


def rewrite(path, column, values):
    table = pq.read_table(path)
    i = table.column_names.index(column)
    if values is None:
        table = table.remove_column(i)
    else:
        flat = pa.array(np.asarray(values, np.float32).reshape(-1))
        table = table.set_column(i, column, pa.FixedSizeListArray.from_arrays(flat, np.shape(values)[1]))
    pq.write_table(table, path)


def expect_episode_error(tmp_path, root, pattern):
    """Without skipping: DataError naming episode 1 and `pattern`; with skipping: 3 episodes and a report."""
    with pytest.raises(DataError, match=pattern) as err:
        build_datasets(make_cfg(tmp_path, root))
    assert "episode 1" in str(err.value) and "skip_bad_samples" in str(err.value)
    train, _, _ = build_datasets(make_cfg(tmp_path, root, skip=True))
    assert sorted(e.index for e in train.episodes) == [0, 2, 3]
    assert len(train.bad_episodes) == 1 and "episode 1" in train.bad_episodes[0]
    return str(err.value)


def test_missing_video_file(root, tmp_path):
    os.remove(os.path.join(root, EP1_VIDEO))
    assert "episode_000001.mp4" in expect_episode_error(tmp_path, root, "does not exist")


def test_missing_parquet_file(root, tmp_path):
    os.remove(os.path.join(root, EP1_DATA))
    assert "episode_000001.parquet" in expect_episode_error(tmp_path, root, "does not exist")


def test_corrupt_parquet(root, tmp_path):
    with open(os.path.join(root, EP1_DATA), "r+b") as f:
        f.seek(0)
        f.write(b"garbage!" * 64)
    assert "episode_000001.parquet" in expect_episode_error(tmp_path, root, "cannot be read")


def test_missing_column(root, tmp_path):
    rewrite(os.path.join(root, EP1_DATA), "action", None)
    message = expect_episode_error(tmp_path, root, "no column")
    assert "'action'" in message and "episode_000001.parquet" in message


def test_nan_values(root, tmp_path):
    action = np.zeros((16, 4), np.float32)
    action[5, 2] = np.nan
    rewrite(os.path.join(root, EP1_DATA), "action", action)
    assert "frame 5" in expect_episode_error(tmp_path, root, "NaN")


def test_wrong_action_dimension(root, tmp_path):
    rewrite(os.path.join(root, EP1_DATA), "action", np.zeros((16, 3), np.float32))
    assert "episode_000001.parquet" in expect_episode_error(tmp_path, root, "dimension 3")
    with pytest.raises(DataError, match="common.action_dim is 5"):
        build_datasets(make_cfg(tmp_path, root, skip=True, action_dim=5))


def test_unknown_feature_and_stats_path(root, tmp_path):
    cfg = make_cfg(tmp_path, root)
    from omegaconf import OmegaConf
    with pytest.raises(DataError, match="no feature 'act'"):
        build_datasets(OmegaConf.merge(cfg, {"dataset": {"action_key": "act"}}))
    with pytest.raises(DataError, match="missing.json does not exist"):
        build_datasets(OmegaConf.merge(cfg, {"dataset": {"stats_path": str(tmp_path / "missing.json")}}))
    with pytest.raises(DataError, match="not a LeRobot dataset"):
        build_datasets(OmegaConf.merge(cfg, {"dataset": {"dataset_dir": str(tmp_path / "nowhere")}}))


def test_corrupt_video_at_sample_time(root, tmp_path):
    path = os.path.join(root, EP1_VIDEO)
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    train, _, _ = build_datasets(make_cfg(tmp_path, root))  # the file exists: found when a sample reads it
    with pytest.raises(DataError) as err:
        train.load((1, 0))
    assert "episode 1" in str(err.value) and "episode_000001.mp4" in str(err.value)
    cfg = make_cfg(tmp_path, root, skip=True)
    train, _, _ = build_datasets(cfg)
    stream = build_train_stream(train, cfg)
    batches = [next(stream) for _ in range(6)]
    for batch in batches:  # full batches, never a bad sample, never a None
        assert batch.video.shape == (4, 3, 3, 16, 16)
        assert 1 not in batch.episode_index.tolist()
    assert stream.skipped > 0 and stream.state_dict()["skipped"] == stream.skipped
    assert "episode_000001.mp4" in stream.bad.messages[0]
    strict = build_train_stream(build_datasets(make_cfg(tmp_path, root))[0], make_cfg(tmp_path, root))
    with pytest.raises(DataError, match="episode_000001.mp4"):
        for _ in range(6):
            next(strict)
