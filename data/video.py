"""Video files through PyAV: frame-accurate reads by timestamp, and an encoder for our writers.

LeRobot addresses a frame by its timestamp (episode `from_timestamp` + the frame's
`timestamp` column), so we do the same: seek to the keyframe before the first wanted
time, decode forward, and keep for each wanted time the frame whose presentation time
is closest. PyAV decodes AV1 (libdav1d), H.264, HEVC and VP9 alike.
"""
import os
from collections import OrderedDict

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from data.errors import DataError

_OPEN_LIMIT = 16  # open containers kept per process (one per camera file in use)
_containers = OrderedDict()
_owner_pid = None
_inherited = []
_to_rgb = None  # reused per process: a fresh converter per frame costs more than the conversion


def _container(path):
    """An open container for `path`, reused across samples of the same process.

    DataLoader workers are forked: a container inherited from the parent shares its file
    offset with the parent, so each process starts its own set.
    """
    global _owner_pid, _to_rgb
    if _owner_pid != os.getpid():
        # Inherited containers belong to the parent. Closing (or garbage-collecting) one here would
        # join decoder threads that do not exist after fork and hang, so they are kept, unused.
        _inherited.extend([*_containers.values(), _to_rgb])
        _containers.clear()
        _to_rgb = VideoReformatter()
        _owner_pid = os.getpid()
    if path in _containers:
        _containers.move_to_end(path)
        return _containers[path]
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    container = av.open(path)
    _containers[path] = container
    while len(_containers) > _OPEN_LIMIT:
        _containers.popitem(last=False)[1].close()
    return container


def _drop(path):
    container = _containers.pop(path, None)
    if container is not None:
        container.close()


def read_frames(path, times, tolerance):
    """RGB frames (uint8 [len(times), H, W, 3]) of `path` nearest to each time in seconds.

    Raises DataError when the file is missing or unreadable, or when a wanted time has no
    frame within `tolerance` seconds.
    """
    try:
        return _read_frames(path, times, tolerance)
    except DataError:
        raise
    except FileNotFoundError:
        raise DataError(f"video file {path} does not exist") from None
    except (av.error.FFmpegError, ValueError, IndexError, OSError) as e:
        _drop(path)
        raise DataError(f"video file {path} cannot be decoded: {e}") from None


def _read_frames(path, times, tolerance):
    container = _container(path)
    stream = container.streams.video[0]
    first, last = min(times), max(times)
    found = _decode_span(container, stream, first, last, tolerance)
    if found and found[0][0] > first + tolerance:  # the seek landed after the target: start over
        found = _decode_span(container, stream, 0.0, last, tolerance, seek=False)
    if not found:
        raise DataError(f"video file {path}: no frame decoded between {first:.4f}s and {last:.4f}s")
    stamps = np.array([t for t, _ in found])
    out = []
    for t in times:
        i = int(np.argmin(np.abs(stamps - t)))
        if abs(stamps[i] - t) > tolerance:
            raise DataError(f"video file {path}: no frame at {t:.4f}s (nearest {stamps[i]:.4f}s, "
                            f"tolerance {tolerance:.4f}s); the video is shorter than its metadata says "
                            f"or its timestamps do not match")
        out.append(_to_rgb.reformat(found[i][1], format="rgb24", threads=1).to_ndarray())  # only the frames kept
    return np.stack(out)


def _decode_span(container, stream, first, last, tolerance, seek=True):
    base = stream.time_base
    offset = max(int((first - tolerance) / base), 0)
    container.seek(offset if seek else 0, stream=stream, backward=True, any_frame=False)
    found = []
    for frame in container.decode(stream):
        if frame.pts is None:
            continue
        t = float(frame.pts * base)
        if t >= first - tolerance:
            found.append((t, frame))
        if t >= last + tolerance:
            break
    return found


def video_info(path):
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


class VideoEncoder:
    """Appends RGB frames to one mp4 at a fixed fps; frame k is shown at k / fps seconds.

    Defaults follow LeRobot's recorder: AV1 (libsvtav1), yuv420p, a keyframe every 2 frames
    (cheap seeking), crf 30.
    """

    def __init__(self, path, fps, width, height, codec="libsvtav1", crf=30, gop=2):
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner otherwise
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.container = av.open(path, "w")
        options = {"g": str(gop), "crf": str(crf)}
        self.stream = self.container.add_stream(codec, rate=fps, options=options)
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = "yuv420p"
        self.count = 0

    def write(self, rgb):
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb, dtype=np.uint8), format="rgb24")
        frame.pts = self.count
        self.count += 1
        for packet in self.stream.encode(frame):
            self.container.mux(packet)

    def close(self):
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()
