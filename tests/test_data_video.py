"""Frame-exact reads with seeking, the resize against PIL's, and the image-column cache."""
import pickle

import av
import numpy as np
import pytest
from PIL import Image

from data import video
from data.lerobot_writer import LeRobotWriter
from data.transforms import resize_frames
from data.video import read_frames
from utils.video_file import VideoEncoder

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
    assert video._videos[path].interval * video._videos[path].tick == pytest.approx(0.2)
    before = video._videos[path].decoded
    # as float32, the way LeRobot stores `timestamp`: a hair off the frame's tick must not cost a GOP
    read_frames(path, [float(np.float32(k / FPS)) for k in (1, 7, 13, 19, 25, 31)], 0.05)
    assert video._videos[path].decoded - before == 12


def pil_resize(frames, size):
    """What data/transforms.py did before: PIL's BILINEAR resize, frame by frame."""
    return np.stack([np.asarray(Image.fromarray(f).resize((size[1], size[0]), Image.BILINEAR)) for f in frames])


@pytest.mark.parametrize("shape,size,exact", [((480, 1280), (120, 320), True),   # Motus: 2 cameras 480x640
                                              ((96, 129), (32, 43), True), ((16, 32), (32, 64), True),
                                              ((240, 320), (160, 213), False), ((40, 40), (8, 8), False),
                                              ((37, 53), (19, 11), False)])
def test_resize_reproduces_pil(shape, size, exact):
    frames = np.random.default_rng(0).integers(0, 256, (2, *shape, 3), dtype=np.uint8)
    diff = np.abs(resize_frames(frames, size).astype(int) - pil_resize(frames, size).astype(int))
    if exact:
        assert diff.max() == 0
    else:  # rounding ties: measured on noise, 0.15% to 2% of values one level off
        assert diff.max() <= 1 and (diff > 0).mean() < 0.03


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


def test_encode_mp4_pads_odd_sizes_and_keeps_fps_and_frames():
    """The mp4 bytes wandb gets: a smooth clip comes back near-exact at the fps asked (7.5 -> 15/2),
    one decoded frame per input frame, padded to even size by one black row and column."""
    import io
    from fractions import Fraction

    from utils.video_file import encode_mp4

    y, x = np.mgrid[:15, :21]
    frames = np.stack([np.stack([x * 3 + 10 * k + 60, y * 3 + 60, np.full_like(x, 100)], -1) for k in range(6)]).astype(np.uint8)
    with av.open(io.BytesIO(encode_mp4(frames, 7.5))) as container:
        stream = container.streams.video[0]
        assert stream.average_rate == Fraction(15, 2)
        got = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
    assert got.shape == (6, 16, 22, 3)
    # the last row and column share their chroma samples with the black padding: compared apart
    assert np.abs(got[:, :14, :20].astype(int) - frames[:, :14, :20]).mean() < 3


PRIORITY_AFTER_WRITING = """
import os, subprocess, sys
import av, numpy as np
from utils.video_file import VideoEncoder, thread_scheduling
if sys.argv[1] == "raw":  # PyAV alone
    container = av.open(sys.argv[2], "w")
    stream = container.add_stream("libsvtav1", rate=10)
    stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
    container.mux(stream.encode(av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")))
else:
    encoder = VideoEncoder(sys.argv[2], 10, 32, 32)
    encoder.write(np.zeros((32, 32, 3), np.uint8))
    encoder.write(np.zeros((32, 32, 3), np.uint8))
    encoder.close()
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"], capture_output=True, text=True)
print(sorted(set(thread_scheduling().values())), child.stdout.strip())
"""


def test_writing_av1_leaves_the_process_and_its_children_at_normal_priority(tmp_path):
    """Run as root, SVT-AV1 turns the thread that opens it real-time (SCHED_FIFO 99), and every process
    started afterwards inherits it; VideoEncoder puts the threads back."""
    import os
    import subprocess
    import sys

    def after(how):
        out = subprocess.run([sys.executable, "-c", PRIORITY_AFTER_WRITING, how, str(tmp_path / f"{how}.mp4")],
                             capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
        return out.stdout.strip().splitlines()[-1]

    assert after("ours") == f"[({os.SCHED_OTHER}, 0)] {os.SCHED_OTHER}"
    if os.geteuid() == 0:  # the promotion this guards against (SVT-AV1 only tries it as root)
        assert f"({os.SCHED_FIFO}, 99)" in after("raw")
