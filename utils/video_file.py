"""Writing mp4 files through PyAV: the one encoder behind dataset writers, evaluation reports and the
videos sent to wandb; reading a whole short clip back (`read_mp4`) for the metrics. (Reading frames by
timestamp is data/video.py's job.)"""
import contextlib
import fractions
import io
import os
import threading
from typing import BinaryIO, Iterator

import av
import numpy as np


class VideoEncoder:
    """Appends RGB frames to one mp4 at a fixed fps; frame k is shown at k / fps seconds.

    `target` is a path or a writable binary file object. Defaults follow LeRobot's recorder: AV1
    (libsvtav1), yuv420p, a keyframe every 2 frames (cheap seeking), crf 30; crf or gop None leaves
    the codec's own default.
    """

    def __init__(self, target: str | BinaryIO, fps: float, width: int, height: int, codec: str = "libsvtav1",
                 crf: int | None = 30, gop: int | None = 2) -> None:
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner otherwise
        if isinstance(target, str):  # the format follows the file name, as for every file we write
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            self.container = av.open(target, "w")
        else:  # a file object has no name to tell the format by
            self.container = av.open(target, "w", format="mp4")
        options = {k: str(v) for k, v in (("g", gop), ("crf", crf)) if v is not None}
        rate = fractions.Fraction(fps).limit_denominator(1001)  # 29.97 -> 30000/1001
        self.stream = self.container.add_stream(codec, rate=rate, options=options)
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = "yuv420p"
        with keep_scheduling():  # opening SVT-AV1 is what raises the priority
            self.stream.codec_context.open()
        self.count = 0

    def write(self, rgb: np.ndarray) -> None:
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb, dtype=np.uint8), format="rgb24")
        frame.pts = self.count
        self.count += 1
        self.container.mux(self.stream.encode(frame))

    def close(self) -> None:
        self.container.mux(self.stream.encode())
        self.container.close()


def thread_scheduling() -> dict[int, tuple[int, int]]:
    """Each thread of this process (its id) -> (scheduling policy, priority)."""
    threads = {}
    for name in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            threads[int(name)] = (os.sched_getscheduler(int(name)), os.sched_getparam(int(name)).sched_priority)
    return threads


@contextlib.contextmanager
def keep_scheduling() -> Iterator[None]:
    """Puts every thread of this process back to the scheduling it had before the block; threads
    started inside the block get the calling thread's.

    Why: run as root (containers, CI) SVT-AV1 gives the thread that opens an encoder, and its own
    worker threads, real-time priority (SCHED_FIFO 99) for good. The process kept it after the video
    was written, and passed it to every process it started later: DataLoader workers, trainers,
    simulators. Real-time threads that wait on each other on the same core starve one another (a
    SCHED_FIFO thread runs until it blocks), so a run could stall for minutes."""
    if not os.path.isdir("/proc/self/task"):  # not Linux: no such promotion seen
        yield
        return
    before = thread_scheduling()
    caller = before[threading.get_native_id()]
    try:
        yield
    finally:
        for tid, now in thread_scheduling().items():
            policy, priority = before.get(tid, caller)
            if now != (policy, priority):
                with contextlib.suppress(OSError):
                    os.sched_setscheduler(tid, policy, os.sched_param(priority))


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """THWC uint8 -> mp4 bytes (H.264 at its default quality; yuv420p halves the chroma resolution,
    so an odd height or width is padded by one pixel)."""
    _, h, w, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))
    buffer = io.BytesIO()
    encoder = VideoEncoder(buffer, fps, w + w % 2, h + h % 2, codec="libx264", crf=None, gop=None)
    for rgb in frames:
        encoder.write(rgb)
    encoder.close()
    return buffer.getvalue()


def read_mp4(path: str) -> tuple[np.ndarray, float]:
    """Every frame of a short video file as uint8 [T, H, W, 3], and its frame rate."""
    with av.open(path) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        fps = float(stream.average_rate or stream.guessed_rate or 0)
    if not frames or fps <= 0:
        raise ValueError(f"{path}: no frames or no frame rate in its video stream")
    return np.stack(frames), fps
