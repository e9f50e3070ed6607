"""Frame-exact reads with seeking, decoder-side resizing, camera sizing, and the image-column cache."""
import pickle
from fractions import Fraction

import av
import numpy as np
import pytest

from data import video
from data.lerobot_writer import LeRobotWriter
from data.transforms import camera_sizes, resize_frames
from data.video import VideoEncoder, read_frames

FPS, LENGTH, SIZE = 10, 40, 32


def write_noise(path, codec, gop):
    """Every frame different (seeded noise), so a frame read names its index."""
    rng = np.random.default_rng(0)
    encoder = VideoEncoder(str(path), FPS, SIZE, SIZE, codec=codec, crf=20, gop=gop)
    for _ in range(LENGTH):
        encoder.write(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    encoder.close()
    return str(path)


def every_frame(path):
    """(presentation times, RGB frames) of a file decoded start to end with no seek."""
    with av.open(path) as container:
        stream = container.streams.video[0]
        frames = [(float(f.pts * stream.time_base), f.to_ndarray(format="rgb24")) for f in container.decode(stream)]
    return np.array([t for t, _ in frames]), np.stack([f for _, f in frames])


@pytest.fixture(scope="module", params=[("libsvtav1", 2), ("libx264", 5), ("libx264", 250)],
                ids=["av1-gop2", "h264-bframes-gop5", "h264-one-keyframe"])
def clip(request, tmp_path_factory):
    codec, gop = request.param
    path = write_noise(tmp_path_factory.mktemp("video") / f"{codec}_{gop}.mp4", codec, gop)
    return path, every_frame(path)


def test_every_time_gets_its_nearest_frame(clip):
    path, (stamps, frames) = clip
    assert len(stamps) == LENGTH
    rng = np.random.default_rng(1)
    tolerance = 0.5 / FPS
    cases = [[k / FPS for k in (1, 7, 13, 19, 25, 31, 37)],       # a window, frames 6 apart
             [k / FPS for k in (39, 0, 20, 20, 3)],                # unordered, repeated, both ends
             (rng.integers(0, LENGTH, 8) + rng.uniform(-0.45, 0.45, 8)).clip(0, (LENGTH - 1)) / FPS]
    for times in cases:
        want = frames[[int(np.argmin(np.abs(stamps - t))) for t in times]]
        np.testing.assert_array_equal(read_frames(path, list(times), tolerance), want)
    with pytest.raises(video.DataError, match=r"no frame at 4\.5000s \(nearest 3\.9000s"):
        read_frames(path, [4.5], tolerance)


def test_seeks_past_frames_nobody_wants(tmp_path):
    """A keyframe every 2 frames, learned from frames 0 to 2: frames 1, 7, ..., 31 then cost 2 decoded
    frames each, not all 32 up to 31."""
    path = write_noise(tmp_path / "gop2.mp4", "libsvtav1", 2)
    read_frames(path, [0.0, 0.2], 0.05)
    assert video._videos[path].interval * video._videos[path].base == Fraction(1, 5)
    before = video._videos[path].decoded
    read_frames(path, [k / FPS for k in (1, 7, 13, 19, 25, 31)], 0.05)
    assert video._videos[path].decoded - before == 12


def test_decoder_resize_matches_pil(tmp_path):
    """swscale's bilinear shrink (one pass from YUV) against PIL's on the full-size RGB frame."""
    y, x = np.mgrid[0:96, 0:128]
    encoder = VideoEncoder(str(tmp_path / "smooth.mp4"), FPS, 128, 96, codec="libx264", crf=10)
    for k in range(3):
        encoder.write(np.stack([x + 60 * k, y * 2, x + y], -1).astype(np.uint8))  # smooth, no wrap
    encoder.close()
    path, times = str(tmp_path / "smooth.mp4"), [0.0, 0.1, 0.2]
    full = read_frames(path, times, 0.05)
    assert full.shape == (3, 96, 128, 3)
    small = read_frames(path, times, 0.05, size=(24, 32)).astype(int)
    assert small.shape == (3, 24, 32, 3)
    diff = np.abs(small - resize_frames(full, (24, 32)).astype(int))
    assert diff.mean() < 1.5 and diff.max() <= 6, (diff.mean(), diff.max())  # measured: 1.13 and 4


def test_camera_sizes_tile_to_the_fit():
    assert camera_sizes([(480, 640), (480, 640)], 384, 320) == [(120, 160), (120, 160)]
    # 480 x 960 tiled -> 160 x 320; the shorter camera keeps its aspect and is padded below
    assert camera_sizes([(480, 640), (240, 320)], 384, 320) == [(160, 213), (80, 107)]
    assert camera_sizes([(16, 16)], 16, 16) == [(16, 16)]
    sizes = camera_sizes([(100, 333), (100, 333), (100, 334)], 64, 100)
    assert sizes == [(10, 33), (10, 34), (10, 33)]  # 100 x 1000 -> 10 x 100; widths add up to 100


def test_image_column_cache_is_per_object(tmp_path):
    from data.lerobot_format import ParquetImages
    root = str(tmp_path / "images")
    features = {"observation.state": {"dtype": "float32", "shape": [2], "names": None},
                "action": {"dtype": "float32", "shape": [2], "names": None},
                "observation.images.wrist": {"dtype": "image", "shape": [4, 6, 3], "names": None}}
    writer = LeRobotWriter(root, 10, features, episodes_per_file=1)
    frames = np.random.default_rng(0).integers(0, 256, (5, 4, 6, 3), dtype=np.uint8)
    writer.add_episode({"observation.state": np.zeros((5, 2), np.float32), "action": np.zeros((5, 2), np.float32),
                        "observation.images.wrist": frames}, "images")
    writer.close()
    path = f"{root}/data/chunk-000/file-000.parquet"
    images = ParquetImages()
    np.testing.assert_array_equal(images.read(path, "observation.images.wrist", [4, 0]), frames[[4, 0]])
    assert list(images._columns) == [(path, "observation.images.wrist")]
    copy = pickle.loads(pickle.dumps(images))  # what a spawned worker gets: no columns, same reads
    assert copy._columns == {}
    np.testing.assert_array_equal(copy.read(path, "observation.images.wrist", [2]), frames[[2]])
    assert ParquetImages()._columns == {}
