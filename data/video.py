"""Video files through PyAV: frame-accurate reads by timestamp (writing is utils/video_file.py).

LeRobot addresses a frame by its timestamp (episode `from_timestamp` + the frame's
`timestamp` column), so we do the same: for each wanted time, keep the frame whose
presentation time is closest. Reaching it, we seek when a keyframe lies between the frame
decoded last and the wanted time (decoding forward would pass frames nobody wants), and
decode on otherwise. Keyframes are learned from the packets as they are read: those seen,
and the longest keyframe interval seen, beyond which a keyframe must lie in unseen parts
too. A wrong guess costs time, never exactness: any seek lands at or before the wanted
frame. With LeRobot's encoder settings (a keyframe every 2 frames) a window of 9 frames 6
apart decodes 9 to 18 frames instead of all 49. PyAV decodes AV1 (libdav1d), H.264, HEVC and VP9 alike.
"""
import bisect
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Sequence, TypeVar

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from data.errors import DataError

T = TypeVar("T")
TimedFrame = tuple[float, av.VideoFrame]
"""A decoded frame and its presentation time in seconds."""

_OPEN_LIMIT = 16  # open files kept per process (one per camera file in use)
_videos: OrderedDict = OrderedDict()
_owner_pid = None
_inherited: list = []
_to_rgb: Any = None  # a VideoReformatter, reused per process: a fresh one per frame costs more than the conversion


def _one_thread() -> dict[str, int]:
    """swscale options for one thread: PyAV 18 picks a thread per core unless told; PyAV 15 (what
    LeRobot 0.4 installs) has no `threads` argument and always uses one."""
    try:
        VideoReformatter().reformat(av.VideoFrame(16, 16, "yuv420p"), format="rgb24", threads=1)
        return {"threads": 1}
    except TypeError:
        return {}


_SWSCALE = _one_thread()


class _Video:
    """One open file: its container, its video stream and what its packets showed of its keyframes."""

    def __init__(self, path: str) -> None:
        self.container = av.open(path)
        self.stream = self.container.streams.video[0]
        # One thread: with frame threads the decoder holds frames back after every seek, and
        # DataLoader workers already use the cores.
        self.stream.codec_context.thread_count = 1
        self.tick = float(self.stream.time_base)  # seconds: float arithmetic (Fraction's costs ms per sample)
        self.keyframes: list[int] = []  # sorted ticks of the keyframes seen
        self.interval: int | None = None  # longest distance between two keyframes read one after the other (ticks)
        self.decoded = 0  # frames decoded since open (the benchmark reports it)

    def saw_keyframe(self, tick: int, previous: int | None) -> None:
        """Note keyframe `tick`; `previous` is the keyframe read just before it (None after a seek)."""
        i = bisect.bisect_left(self.keyframes, tick)
        if i == len(self.keyframes) or self.keyframes[i] != tick:
            self.keyframes.insert(i, tick)
        if previous is not None:
            self.interval = max(self.interval or 0, tick - previous)

    def ticks(self, t: float) -> int:
        """Seconds -> the nearest stream tick. Wanted times carry float32 error (LeRobot stores
        `timestamp` as float32: up to a tenth of a tick after a minute), which rounding absorbs."""
        return max(round(t / self.tick), 0)

    def keyframe_before(self, tick: int, inclusive: bool = True) -> int | None:
        """The last keyframe at (or, with inclusive=False, strictly) before `tick`, or None."""
        i = (bisect.bisect_right if inclusive else bisect.bisect_left)(self.keyframes, tick) - 1
        return self.keyframes[i] if i >= 0 else None

    def worth_seeking(self, position: float, t: float) -> bool:
        """True when a keyframe lies after `position` and at or before `t` (seconds), as far as the
        packets read so far tell: seeking there skips frames that decoding on would pass."""
        key = self.keyframe_before(self.ticks(t))
        if key is not None and key * self.tick > position:
            return True
        return self.interval is not None and t - position >= self.interval * self.tick

    def close(self) -> None:
        self.container.close()


class _Cursor:
    """Frames in presentation order from the keyframe at or before tick `start` (0: the file's start)."""

    def __init__(self, video: _Video, start: int) -> None:
        self.video = video
        video.container.seek(start, stream=video.stream, backward=True, any_frame=False)
        self.frames = self._decode()
        self.last: TimedFrame | None = None  # the frame before head
        self.head = next(self.frames, None)

    def _decode(self) -> Iterator[TimedFrame]:
        video, previous = self.video, None
        for packet in video.container.demux(video.stream):
            if packet.is_keyframe and packet.pts is not None:
                video.saw_keyframe(packet.pts, previous)
                previous = packet.pts
            for frame in packet.decode():
                video.decoded += 1
                if frame.pts is not None:
                    yield frame.pts * video.tick, frame

    @property
    def position(self) -> float:
        """Time of the newest decoded frame (-inf before the first)."""
        newest = self.head or self.last
        return newest[0] if newest else float("-inf")

    def nearest(self, t: float) -> TimedFrame | None:
        """(time, frame) closest to `t` (the earlier one on a tie); None when nothing was decoded.

        Decodes up to the first frame on or after t's tick (not after `t` itself: a float32 time a
        hair past its frame would cost decoding the next frame too)."""
        tick = self.video.ticks(t)
        while self.head is not None and self.video.ticks(self.head[0]) < tick:
            self.last, self.head = self.head, next(self.frames, None)
        candidates = [c for c in (self.last, self.head) if c is not None]
        return min(candidates, key=lambda c: abs(c[0] - t)) if candidates else None


def _video(path: str) -> _Video:
    """The open `_Video` of `path`, reused across samples of the same process.

    DataLoader workers are forked: a container inherited from the parent shares its file
    offset with the parent, so each process starts its own set.
    """
    global _owner_pid, _to_rgb
    if _owner_pid != os.getpid():
        # Inherited containers belong to the parent. Closing (or garbage-collecting) one here would
        # join decoder threads that do not exist after fork and hang, so they are kept, unused.
        _inherited.extend([*_videos.values(), _to_rgb])
        _videos.clear()
        _to_rgb = VideoReformatter()
        _owner_pid = os.getpid()
    if path in _videos:
        _videos.move_to_end(path)
        return _videos[path]
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    _videos[path] = _Video(path)
    while len(_videos) > _OPEN_LIMIT:
        _videos.popitem(last=False)[1].close()
    return _videos[path]


def _drop(path: str) -> None:
    video = _videos.pop(path, None)
    if video is not None:
        video.close()


def _guarded(path: str, read: Callable[[], T]) -> T:
    """read() with PyAV's and the OS's errors turned into a DataError naming `path`."""
    try:
        return read()
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"video file {path} does not exist") from None
    except (av.error.FFmpegError, ValueError, IndexError, OSError) as e:
        _drop(path)
        raise DataError(f"video file {path} cannot be decoded: {e}") from None


def read_frames(path: str, times: Sequence[float], tolerance: float) -> np.ndarray:
    """RGB frames (uint8 [len(times), H, W, 3]) of `path` nearest to each time in seconds.

    Raises DataError when the file is missing or unreadable, or when a wanted time has no
    frame within `tolerance` seconds.
    """
    return _guarded(path, lambda: _read_frames(path, times, tolerance))


def _seek(video: _Video, t: float) -> _Cursor:
    """A cursor whose first frame is at or before `t`, so that the frame nearest `t` is ahead of it.

    Seeking goes by decode time: where frames are reordered (B-frames), the keyframe found can
    show after `t`; then the keyframe before it is tried, down to the file's start.
    """
    target = start = video.ticks(t)
    while True:
        cursor = _Cursor(video, start)
        if cursor.head is None or video.ticks(cursor.head[0]) <= target or start == 0:
            return cursor
        start = video.keyframe_before(start, inclusive=False) or 0


def _read_frames(path: str, times: Sequence[float], tolerance: float) -> np.ndarray:
    video = _video(path)
    picked, cursor = {}, None
    for t in sorted(set(times)):
        if cursor is None or video.worth_seeking(cursor.position, t):
            cursor = _seek(video, t)
        found = cursor.nearest(t)
        if found is None:
            raise DataError(f"video file {path}: no frame decoded near {t:.4f}s")
        if abs(found[0] - t) > tolerance:
            raise DataError(f"video file {path}: no frame at {t:.4f}s (nearest {found[0]:.4f}s, "
                            f"tolerance {tolerance:.4f}s); the video is shorter than its metadata says "
                            f"or its timestamps do not match")
        picked[t] = _to_rgb.reformat(found[1], format="rgb24", **_SWSCALE).to_ndarray()
    return np.stack([picked[t] for t in times])


def video_info(path: str) -> dict[str, Any]:
    """The `info` block LeRobot stores for a video feature in meta/info.json."""
    with av.open(path) as container:
        stream = container.streams.video[0]
        return {
            "video.height": stream.height,
            "video.width": stream.width,
            "video.codec": stream.codec_context.codec.canonical_name,
            "video.pix_fmt": stream.pix_fmt,
            "video.is_depth_map": False,
            "video.fps": int(stream.base_rate),
            "video.channels": 3,
            "has_audio": False,
        }
