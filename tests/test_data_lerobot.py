"""Reading LeRobot v2.1 and v3.0 folders: frame indices, values and decoded pixels."""
import json
import os
import subprocess

import numpy as np
import pyarrow.parquet as pq
import pytest

from data import DataError, build_datasets, build_train_stream
from data.camera_stats import sampled_pixels
from data.lerobot_writer import LeRobotWriter
from data.synthetic import episode_motion, generate, render
from tests.helpers import ROOT, config_from

H, W = 32, 48  # video size = image size: the decoded pixels are compared without resampling


def make_cfg(tmp_path, dataset, **common):
    base = {"common": {"action_dim": 4, "state_dim": 4, "num_video_frames": 2, "video_height": H, "video_width": W,
                       "global_downsample_rate": 2, "video_action_freq_ratio": 2, **common},
            "dataset": {"type": "lerobot", "val_fraction": 0.0, "normalization": "none", **dataset},
            "training": {"batch_size": 2, "seed": 3}, "system": {"num_workers": 0}}
    return config_from(tmp_path, base)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lerobot")
    out = {}
    for version, per_file in (("v3.0", 2), ("v2.1", 1000)):
        out[version] = str(root / version)
        generate(out[version], num_episodes=3, episode_length=20, fps=10, image_height=H, image_width=W,
                 seed=5, codec="libx264", version=version, episodes_per_file=per_file)
    return out


def expected_episode(k, length=20, seed=5):
    rng = np.random.default_rng(seed)
    for _ in range(k + 1):
        state, action, goals = episode_motion(rng, length, 2)
    return state, action, goals


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_layout_files(folders, version):
    root = folders[version]
    info = json.load(open(os.path.join(root, "meta", "info.json")))
    assert info["codebase_version"] == version and info["total_episodes"] == 3 and info["total_frames"] == 60
    assert info["features"]["observation.images.top"]["info"]["video.fps"] == 10
    if version == "v3.0":
        episodes = pq.read_table(os.path.join(root, "meta/episodes/chunk-000/file-000.parquet")).to_pylist()
        # two episodes per file: the third starts a new data and video file at time 0
        assert [e["data/file_index"] for e in episodes] == [0, 0, 1]
        assert [e["videos/observation.images.top/from_timestamp"] for e in episodes] == [0.0, 2.0, 0.0]
        assert [e["dataset_from_index"] for e in episodes] == [0, 20, 40]
        tasks = pq.read_table(os.path.join(root, "meta/tasks.parquet"))
        assert tasks.column("task").to_pylist() == ["move the red square and the blue square to the dots"]
    else:
        assert os.path.isfile(os.path.join(root, "data/chunk-000/episode_000002.parquet"))
        assert os.path.isfile(os.path.join(root, "videos/chunk-000/observation.images.top/episode_000002.mp4"))


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_window_values_and_pixels(folders, version, tmp_path):
    cfg = make_cfg(tmp_path, {"dataset_dir": folders[version]}, state_dim=8)
    train, val, stats = build_datasets(cfg)
    assert val is None and train.num_episodes() == 3 and train.image_keys == ["observation.images.top"]
    for i, c in [(0, 0), (1, 11), (2, 5)]:  # 11 = the last condition frame: 11 + 2*2*2 = 19
        ep = train.episodes[i]
        assert ep.index == i and ep.length == 20
        sample = train.load((i, c))
        state, action, goals = expected_episode(i)
        np.testing.assert_array_equal(sample["state"].numpy(), np.concatenate([state[c], goals[c]]))
        np.testing.assert_array_equal(sample["actions"].numpy(), action[[c + 2, c + 4, c + 6, c + 8]])
        assert sample["frame_index"] == c and sample["episode_index"] == i
        assert sample["instruction"] == "move the red square and the blue square to the dots"
        video = sample["video"].numpy()
        assert video.shape == (3, 3, H, W) and video.min() >= -1 and video.max() <= 1
        for j, frame in enumerate([c, c + 4, c + 8]):
            want = render(state[frame], H, W, goals[frame]).astype(np.float32).transpose(2, 0, 1) / 127.5 - 1
            err = np.abs(video[j] - want)
            assert err.mean() < 0.03, (version, i, c, j, err.mean())  # codec tolerance
            assert np.median(err) < 0.02


def test_windows_past_the_end_hold_the_last_frame(folders, tmp_path):
    """dataset.pad_episode_end: every frame followed by an action is a condition frame (18 of 20 with
    d = 2), and what a window reads past frame 19 is frame 19 (its action and picture; the state is the
    condition frame's)."""
    cfg = make_cfg(tmp_path, {"dataset_dir": folders["v3.0"], "pad_episode_end": True}, state_dim=8)
    train, _, _ = build_datasets(cfg)
    assert len(train) == 3 * 18 and train.spec.num_windows(20) == 18
    state, action, goals = expected_episode(1)
    for c, frames, actions in [(11, [11, 15, 19], [13, 15, 17, 19]), (17, [17, 19, 19], [19, 19, 19, 19])]:
        sample = train.load((1, c))
        np.testing.assert_array_equal(sample["actions"].numpy(), action[actions])
        np.testing.assert_array_equal(sample["state"].numpy(), np.concatenate([state[c], goals[c]]))
        video = sample["video"].numpy()
        for j, frame in enumerate(frames):
            want = render(state[frame], H, W, goals[frame]).astype(np.float32).transpose(2, 0, 1) / 127.5 - 1
            assert np.abs(video[j] - want).mean() < 0.03, (c, j)


def test_two_cameras_tiled_and_selected(tmp_path):
    root = str(tmp_path / "two_cams")
    features = {"observation.state": {"dtype": "float32", "shape": [4], "names": None},
                "action": {"dtype": "float32", "shape": [4], "names": None},
                "observation.images.a": {"dtype": "video", "shape": [16, 16, 3], "names": None},
                "observation.images.b": {"dtype": "video", "shape": [16, 16, 3], "names": None}}
    writer = LeRobotWriter(root, 10, features, codec="libx264")
    red, blue = np.zeros((12, 16, 16, 3), np.uint8), np.zeros((12, 16, 16, 3), np.uint8)
    red[..., 0], blue[..., 2] = 255, 255
    values = np.arange(48, dtype=np.float32).reshape(12, 4)
    writer.add_episode({"observation.state": values, "action": values, "observation.images.a": red,
                        "observation.images.b": blue}, "two cameras")
    writer.close()
    cfg = make_cfg(tmp_path, {"dataset_dir": root}, num_video_frames=1, video_height=32, video_width=32)
    train, _, _ = build_datasets(cfg)
    video = train.load((0, 0))["video"].numpy()  # 16 x 32 tiled -> fitted into 32 x 32: bars above and below
    assert video.shape == (2, 3, 32, 32)
    np.testing.assert_allclose(video[:, :, :8], -1.0)
    np.testing.assert_allclose(video[:, :, 24:], -1.0)
    assert video[0, 0, 16, 4] > 0.9 and video[0, 2, 16, 4] < -0.9     # left half: camera a (red)
    assert video[0, 2, 16, 28] > 0.9 and video[0, 0, 16, 28] < -0.9   # right half: camera b (blue)
    only_b = make_cfg(tmp_path, {"dataset_dir": root, "image_keys": ["observation.images.b"]},
                      num_video_frames=1, video_height=16, video_width=16)
    video = build_datasets(only_b)[0].load((0, 0))["video"].numpy()
    assert video[0, 2].mean() > 0.9
    with pytest.raises(DataError, match="observation.images.c"):
        build_datasets(make_cfg(tmp_path, {"dataset_dir": root, "image_keys": ["observation.images.c"]}))


def test_mixed_folders_with_weights(folders, tmp_path):
    dirs = [folders["v3.0"], folders["v2.1"]]
    cfg = make_cfg(tmp_path, {"dataset_dir": dirs, "weights": [1.0, 0.0]}, state_dim=8)
    train, _, _ = build_datasets(cfg)
    assert train.num_episodes() == 6
    stream = build_train_stream(train, cfg)
    sources = {train.episodes[train.draw(np.random.default_rng(n))[0]].source for n in range(50)}
    assert sources == {0}
    batch = next(stream)
    assert batch.video.shape == (2, 3, 3, H, W)
    cfg = make_cfg(tmp_path, {"dataset_dir": dirs, "weights": [1.0, 3.0]}, state_dim=8)
    train, _, _ = build_datasets(cfg)
    share = np.mean([train.episodes[train.draw(np.random.default_rng(n))[0]].source for n in range(400)])
    assert 0.65 < share < 0.85  # three quarters from the second folder


@pytest.mark.parametrize("column,kind", [("__index_level_0__", "large_string"), ("task", "string")])
def test_tasks_parquet_variants(folders, tmp_path, column, kind):
    import shutil

    import pyarrow as pa
    root = str(tmp_path / "copy")
    shutil.copytree(folders["v3.0"], root)
    text = pa.array(["push the squares"], pa.large_string() if kind == "large_string" else pa.string())
    pq.write_table(pa.table({"task_index": pa.array([0], pa.int64()), column: text}),
                   os.path.join(root, "meta", "tasks.parquet"))
    train, _, _ = build_datasets(make_cfg(tmp_path, {"dataset_dir": root}, state_dim=8))
    assert train.load((0, 0))["instruction"] == "push the squares"


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_image_features_in_parquet(tmp_path, version):
    root = str(tmp_path / "images")
    features = {"observation.state": {"dtype": "float32", "shape": [4], "names": None},
                "action": {"dtype": "float32", "shape": [4], "names": None},
                "observation.images.wrist": {"dtype": "image", "shape": [8, 12, 3],
                                             "names": ["height", "width", "channel"]}}
    writer = LeRobotWriter(root, 10, features, version=version, episodes_per_file=1)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (10, 8, 12, 3), dtype=np.uint8) for _ in range(2)]
    for k in range(2):
        values = np.full((10, 4), k, np.float32)
        writer.add_episode({"observation.state": values, "action": values, "observation.images.wrist": frames[k]},
                           "images")
    writer.close()
    cfg = make_cfg(tmp_path, {"dataset_dir": root}, video_height=8, video_width=12)
    train, _, _ = build_datasets(cfg)
    video = train.load((1, 1))["video"].numpy()  # PNG is lossless: exact pixels of frames 1, 5, 9
    np.testing.assert_allclose(video, frames[1][[1, 5, 9]].transpose(0, 3, 1, 2) / 127.5 - 1, atol=1e-6)


@pytest.mark.parametrize("version,codec", [("v3.0", "libsvtav1"), ("v2.1", "libx264")])
def test_frame_accurate_seeking(tmp_path, version, codec):
    """Frame k of episode e is grey level 12 k + 4 e: the decoded level names the frame read."""
    root = str(tmp_path / "grey")
    features = {"observation.state": {"dtype": "float32", "shape": [4], "names": None},
                "action": {"dtype": "float32", "shape": [4], "names": None},
                "observation.images.top": {"dtype": "video", "shape": [16, 16, 3], "names": None}}
    writer = LeRobotWriter(root, 15, features, version=version, codec=codec, episodes_per_file=2)
    for e in range(3):  # v3.0: episodes 0 and 1 share a file (episode 1 starts at 20 / 15 s), episode 2 starts a new one
        grey = np.repeat((12 * np.arange(20) + 4 * e).astype(np.uint8), 16 * 16 * 3).reshape(20, 16, 16, 3)
        values = np.zeros((20, 4), np.float32)
        writer.add_episode({"observation.state": values, "action": values, "observation.images.top": grey}, "grey")
    writer.close()
    train, _, _ = build_datasets(make_cfg(tmp_path, {"dataset_dir": root}, video_height=16, video_width=16))
    for e in range(3):
        for c in (0, 3, 11):
            video = (train.load((e, c))["video"].numpy() + 1) * 127.5
            levels = video.mean(axis=(1, 2, 3))
            np.testing.assert_allclose(levels, 12 * np.array([c, c + 4, c + 8]) + 4 * e, atol=3)


# ---- camera statistics, as LeRobot's writer stores them -------------------------------------------------
LEROBOT_CAMERA_STATS = ["count", "max", "mean", "min", "q01", "q10", "q50", "q90", "q99", "std"]
CAMERAS = {"observation.images.top": ("video", 24, 32), "observation.images.wrist": ("image", 8, 12)}
LENGTHS = (150, 40)
# LeRobot's sample: every frame of an episode under 100 frames, else max(100, int(n ** 0.75)) evenly spaced
PICKS = (np.round(np.linspace(0, 149, 100)).astype(int), np.arange(40))


@pytest.fixture(scope="module")
def camera_folder(tmp_path_factory):
    """Two episodes (150 and 40 frames) with a video and an image camera; each channel's pixels in its own
    range, the second episode's brighter, so min and max differ per channel and per episode. The image
    camera's pixels are random, the video camera's frames flat (a random colour each, which the codec keeps)."""
    root = str(tmp_path_factory.mktemp("cameras") / "data")
    features = {"observation.state": {"dtype": "float32", "shape": [4], "names": None},
                "action": {"dtype": "float32", "shape": [4], "names": None}}
    features.update({k: {"dtype": d, "shape": [h, w, 3], "names": ["height", "width", "channels"]}
                     for k, (d, h, w) in CAMERAS.items()})
    writer = LeRobotWriter(root, 10, features, codec="libx264")
    rng = np.random.default_rng(11)
    frames = {key: [] for key in CAMERAS}
    for e, length in enumerate(LENGTHS):
        for key, (dtype, h, w) in CAMERAS.items():
            low = np.array([10, 40, 70]) + 20 * e
            shape = (length, h, w, 3) if dtype == "image" else (length, 1, 1, 3)
            frames[key].append(np.broadcast_to(rng.integers(low, low + 120, shape), (length, h, w, 3)).astype(np.uint8))
        values = np.full((length, 4), e, np.float32)
        writer.add_episode({"observation.state": values, "action": values, **{k: v[e] for k, v in frames.items()}},
                           "cameras")
    writer.close()
    return root, frames


def numpy_stats(frames):
    """Per-channel statistics of uint8 frames [N, H, W, 3] scaled to [0, 1], computed here independently."""
    x = frames.reshape(-1, 3).astype(np.float64) / 255
    out = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0)}
    out.update({f"q{round(q * 100):02d}": np.quantile(x, q, axis=0) for q in (0.01, 0.1, 0.5, 0.9, 0.99)})
    return out


def test_camera_stats_as_lerobot_stores_them(camera_folder):
    root, frames = camera_folder
    with open(os.path.join(root, "meta", "stats.json")) as f:
        dataset = json.load(f)
    episodes = pq.read_table(os.path.join(root, "meta/episodes/chunk-000/file-000.parquet")).to_pylist()
    assert list(PICKS[0][:6]) == [0, 2, 3, 5, 6, 8] and PICKS[0][-1] == 149
    for key in CAMERAS:
        sample = [frames[key][e][PICKS[e]] for e in range(2)]
        per_episode = [{n: ep[f"stats/{key}/{n}"] for n in LEROBOT_CAMERA_STATS} for ep in episodes]
        for got, pixels, count in [(dataset[key], np.concatenate(sample), 140), (per_episode[0], sample[0], 100),
                                   (per_episode[1], sample[1], 40)]:
            assert sorted(got) == LEROBOT_CAMERA_STATS and got["count"] == [count]
            for name, want in numpy_stats(pixels).items():
                assert np.shape(got[name]) == (3, 1, 1), (key, name)
                np.testing.assert_allclose(np.reshape(got[name], 3), want, rtol=1e-12, atol=1e-15, err_msg=name)
    wrist = "observation.images.wrist"  # random pixels: each channel's range is reached
    assert np.reshape(dataset[wrist]["min"], 3).tolist() == [10 / 255, 40 / 255, 70 / 255]
    assert np.reshape(dataset[wrist]["max"], 3).tolist() == [149 / 255, 179 / 255, 209 / 255]
    assert np.reshape(episodes[1][f"stats/{wrist}/min"], 3).tolist() == [30 / 255, 60 / 255, 90 / 255]
    assert sorted(dataset["action"]) == ["count", "max", "mean", "min", "std"]  # numeric features as before


def test_camera_stats_stride_large_frames():
    """LeRobot strides a frame whose longer side reaches 300 pixels by int(longer side / 150)."""
    wide = (np.arange(2 * 300 * 640 * 3) % 251).astype(np.uint8).reshape(2, 300, 640, 3)
    np.testing.assert_array_equal(sampled_pixels(wide), wide[:, ::4, ::4])  # 640 / 150 -> 4
    tall = (np.arange(2 * 480 * 200 * 3) % 251).astype(np.uint8).reshape(2, 480, 200, 3)
    np.testing.assert_array_equal(sampled_pixels(tall), tall[:, ::3, ::3])
    small = wide[:, :299, :299]
    np.testing.assert_array_equal(sampled_pixels(small), small)


def test_camera_frames_must_be_uint8(tmp_path):
    features = {"action": {"dtype": "float32", "shape": [2], "names": None},
                "observation.images.top": {"dtype": "video", "shape": [8, 8, 3], "names": None}}
    writer = LeRobotWriter(str(tmp_path / "bad"), 10, features, codec="libx264")
    with pytest.raises(ValueError, match=r"camera 'observation.images.top': frames must be a uint8 array .* float32"):
        writer.add_episode({"action": np.zeros((3, 2), np.float32),
                            "observation.images.top": np.zeros((3, 8, 8, 3), np.float32)}, "bad")


ACT_PYTHON = os.path.join(ROOT, ".venv-act", "bin", "python")


@pytest.mark.skipif(not os.path.isfile(ACT_PYTHON), reason="LeRobot's environment .venv-act is absent; "
                    "`python benchmarks/act_reference.py setup` creates it")
def test_lerobot_reads_our_folder(camera_folder, tmp_path):
    """The official library (lerobot 0.4.4 in .venv-act) loads the folder: the camera statistics with
    LeRobot's names and shapes, its own pooling of the episodes' statistics equal to meta/stats.json, its
    normalisation using them, and the frame of episode 1, step 5."""
    root, frames = camera_folder
    out = str(tmp_path / "frames.npz")
    done = subprocess.run([ACT_PYTHON, os.path.join(ROOT, "benchmarks", "act_reference.py"), "check", root,
                           "--index", str(LENGTHS[0] + 5), "--frames-out", out], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(report["lerobot_stat_names"]) == LEROBOT_CAMERA_STATS
    assert sorted(report["cameras"]) == sorted(CAMERAS)
    for key, (_, h, w) in CAMERAS.items():
        got = report[key]
        assert got["stat_names"] == LEROBOT_CAMERA_STATS
        assert got["shapes"] == {n: [1] if n == "count" else [3, 1, 1] for n in LEROBOT_CAMERA_STATS}
        assert max(got["pooled_minus_stats_json"].values()) < 1e-12, got["pooled_minus_stats_json"]
        assert got["normalized_minus_expected"] < 1e-5
        assert got["frame_shape"] == [3, h, w]
    decoded = np.load(out)
    want = {k: frames[k][1][5].transpose(2, 0, 1) / 255 for k in CAMERAS}
    np.testing.assert_allclose(decoded["observation.images.wrist"], want["observation.images.wrist"], atol=1e-6)
    np.testing.assert_allclose(decoded["observation.images.top"], want["observation.images.top"], atol=3 / 255)
