"""Write LeRobot datasets (v3.0, and v2.1 for tests) without the LeRobot library.

Used by the synthetic generator and the RoboTwin converter, and by the tests to build
v2.1 and v3.0 folders. Cameras are videos (dtype "video", one mp4 per camera) or images
(dtype "image", PNG bytes inside the parquet, as LeRobot's use_videos=False). The layout,
column names and info.json fields follow LeRobot's published format (`codebase_version`, `features` with dtype/shape/names and a video
`info` block, `data_path`/`video_path` templates, `chunks_size`; v3.0 episodes parquet
with `data/chunk_index`, `videos/{key}/from_timestamp`, `dataset_from_index`, ...), so
the official library and our reader both load what this writes.

Statistics, per episode and in meta/stats.json: per dimension for numeric features (min, max, mean,
std, count; LeRobot 0.4.4 also stores quantiles there), and per RGB channel for cameras as LeRobot
stores them (data/camera_stats.py: min, max, mean, std, quantiles and count of a sample of frames
scaled to [0, 1], shaped [3, 1, 1]), the entries LeRobot's trainer reads to normalise pictures.
Our reader uses none of them.

Usage:
    writer = LeRobotWriter(root, fps=30, features={
        "observation.state": {"dtype": "float32", "shape": [4], "names": ["x0", "y0", "x1", "y1"]},
        "action": {"dtype": "float32", "shape": [4], "names": None},
        "observation.images.top": {"dtype": "video", "shape": [48, 64, 3],
                                   "names": ["height", "width", "channels"]}})
    writer.add_episode({"observation.state": s, "action": a, "observation.images.top": rgb}, "task")
    writer.close()
"""
import io
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from data.camera_stats import LEVELS, histogram, sample_indices, stats_from_histogram
from data.video import video_info
from utils.video_file import VideoEncoder

V30_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"

DEFAULT_FEATURES = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}


def _column(values: np.ndarray, dtype: str, shape: Sequence[int]) -> pa.Array:
    """An arrow column as LeRobot (HF datasets) stores it: scalars for shape [1], fixed lists otherwise."""
    values = np.asarray(values, dtype=dtype)
    if list(shape) == [1]:
        return pa.array(values.reshape(-1))
    flat = pa.array(values.reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, int(np.prod(shape)))


def _numeric(feature: Mapping[str, Any]) -> bool:
    return feature["dtype"] not in ("video", "image")


def _image_column(frames: np.ndarray) -> pa.StructArray:
    """Frames as PNG bytes in HF datasets' Image layout: struct<bytes: binary, path: string>."""
    blobs = []
    for rgb in frames:
        buf = io.BytesIO()
        Image.fromarray(np.asarray(rgb, dtype=np.uint8)).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    return pa.StructArray.from_arrays([pa.array(blobs, pa.binary()), pa.array([None] * len(blobs), pa.string())],
                                      names=["bytes", "path"])


def _stats(values: np.ndarray) -> dict[str, list[float]]:
    values = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    return {"min": values.min(0).tolist(), "max": values.max(0).tolist(), "mean": values.mean(0).tolist(),
            "std": values.std(0).tolist(), "count": [len(values)]}


def write_tasks_parquet(path: str, tasks: Sequence[str]) -> None:
    """meta/tasks.parquet: a `task_index` column indexed by the task string, as pandas writes it."""
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())})
    pandas_meta = {
        "index_columns": ["task"], "column_indexes": [],
        "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                     "numpy_type": "int64", "metadata": None},
                    {"name": "task", "field_name": "task", "pandas_type": "unicode",
                     "numpy_type": "object", "metadata": None}],
        "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3"}
    table = table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})
    pq.write_table(table, path)


class LeRobotWriter:
    """Appends episodes to a new LeRobot folder; `close()` writes the metadata."""

    def __init__(self, root: str, fps: float, features: dict[str, dict[str, Any]], version: str = "v3.0",
                 robot_type: str | None = None, codec: str = "libsvtav1", crf: int = 30, episodes_per_file: int = 1000,
                 chunks_size: int = 1000) -> None:
        if version not in ("v3.0", "v2.1"):
            raise ValueError(f"LeRobotWriter: version {version!r}; expected v3.0 or v2.1")
        if os.path.exists(os.path.join(root, "meta", "info.json")):
            raise FileExistsError(f"{root} already holds a LeRobot dataset")
        self.root, self.fps, self.version = root, fps, version
        self.features = {k: dict(v) for k, v in features.items()}
        self.video_keys = [k for k, v in features.items() if v["dtype"] == "video"]
        self.robot_type, self.codec, self.crf = robot_type, codec, crf
        self.episodes_per_file, self.chunks_size = episodes_per_file, chunks_size
        self.tasks: list[str] = []
        self.episodes: list[dict[str, Any]] = []
        self.total_frames = 0
        self._file_number = 0          # v3.0: running number of the current data/video file
        self._file_episodes = 0
        self._file_tables: list = []
        self._encoders: dict[str, VideoEncoder] = {}
        self._video_frames: dict[str, int] = {}        # v3.0: frames already in the current video file, per camera
        # per camera: the histogram of every episode's sampled pixels, and how many frames were sampled
        self._camera_hist: dict[str, np.ndarray] = {k: np.zeros((3, LEVELS), np.int64)
                                                    for k, f in features.items() if not _numeric(f)}
        self._camera_frames = dict.fromkeys(self._camera_hist, 0)

    # ---- episodes -------------------------------------------------------------------------
    def add_episode(self, frames: dict[str, np.ndarray], task: str) -> None:
        length = len(next(iter(frames.values())))
        for key, feature in self.features.items():
            if key not in frames:
                raise KeyError(f"add_episode: feature {key!r} missing from the episode")
            if len(frames[key]) != length:
                raise ValueError(f"add_episode: {key!r} has {len(frames[key])} frames, expected {length}")
        hists = {key: histogram(frames[key], key) for key in self._camera_hist}  # checks the frames are uint8 RGB
        if task not in self.tasks:
            self.tasks.append(task)
        ep = len(self.episodes)
        columns = {}
        for key, feature in self.features.items():
            if feature["dtype"] == "image":
                columns[key] = _image_column(frames[key])
            elif feature["dtype"] != "video":
                columns[key] = _column(frames[key], feature["dtype"], feature["shape"])
        columns["timestamp"] = pa.array((np.arange(length) / self.fps).astype(np.float32))
        columns["frame_index"] = pa.array(np.arange(length, dtype=np.int64))
        columns["episode_index"] = pa.array(np.full(length, ep, dtype=np.int64))
        columns["index"] = pa.array(np.arange(self.total_frames, self.total_frames + length, dtype=np.int64))
        columns["task_index"] = pa.array(np.full(length, self.tasks.index(task), dtype=np.int64))
        table = pa.table(columns)
        stats = {k: _stats(frames[k]) for k, f in self.features.items() if _numeric(f)}
        for key, hist in hists.items():
            sampled = len(sample_indices(length))
            stats[key] = stats_from_histogram(hist, sampled)
            self._camera_hist[key] += hist
            self._camera_frames[key] += sampled
        meta = {"episode_index": ep, "tasks": [task], "length": length, "stats": stats}
        if self.version == "v3.0":
            meta.update(self._add_v30(table, frames, length))
        else:
            self._add_v21(table, frames, ep)
        self.episodes.append(meta)
        self.total_frames += length

    def _chunk_file(self) -> tuple[int, int]:
        return self._file_number // self.chunks_size, self._file_number % self.chunks_size

    def _add_v30(self, table: pa.Table, frames: dict[str, np.ndarray], length: int) -> dict[str, int | float]:
        if self._file_episodes == self.episodes_per_file:
            self._flush_v30_file()
        chunk, file = self._chunk_file()
        meta: dict[str, int | float] = {"data/chunk_index": chunk, "data/file_index": file,
                "dataset_from_index": self.total_frames, "dataset_to_index": self.total_frames + length}
        self._file_tables.append(table)
        for key in self.video_keys:
            encoder = self._encoder(key, frames[key], V30_VIDEO_PATH.format(
                video_key=key, chunk_index=chunk, file_index=file))
            start = self._video_frames.get(key, 0)
            for rgb in frames[key]:
                encoder.write(rgb)
            self._video_frames[key] = start + length
            meta.update({f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                         f"videos/{key}/from_timestamp": start / self.fps,
                         f"videos/{key}/to_timestamp": (start + length) / self.fps})
        self._file_episodes += 1
        return meta

    def _flush_v30_file(self) -> None:
        if not self._file_tables:
            return
        chunk, file = self._chunk_file()
        path = os.path.join(self.root, V30_DATA_PATH.format(chunk_index=chunk, file_index=file))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(pa.concat_tables(self._file_tables), path)
        for encoder in self._encoders.values():
            encoder.close()
        self._encoders, self._video_frames, self._file_tables = {}, {}, []
        self._file_number += 1
        self._file_episodes = 0

    def _add_v21(self, table: pa.Table, frames: dict[str, np.ndarray], ep: int) -> None:
        chunk = ep // self.chunks_size
        path = os.path.join(self.root, V21_DATA_PATH.format(episode_chunk=chunk, episode_index=ep))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(table, path)
        for key in self.video_keys:
            encoder = self._encoder(key, frames[key], V21_VIDEO_PATH.format(
                episode_chunk=chunk, video_key=key, episode_index=ep))
            for rgb in frames[key]:
                encoder.write(rgb)
            encoder.close()
            self._encoders.pop(key)

    def _encoder(self, key: str, frames: np.ndarray, relpath: str) -> VideoEncoder:
        if key not in self._encoders:
            height, width = np.asarray(frames[0]).shape[:2]
            self._encoders[key] = VideoEncoder(os.path.join(self.root, relpath), self.fps, width, height,
                                               codec=self.codec, crf=self.crf)
        return self._encoders[key]

    # ---- metadata -------------------------------------------------------------------------
    def close(self) -> None:
        if self.version == "v3.0":
            self._flush_v30_file()
        os.makedirs(os.path.join(self.root, "meta"), exist_ok=True)
        first_video = {"v3.0": V30_VIDEO_PATH.format(video_key="{k}", chunk_index=0, file_index=0),
                       "v2.1": V21_VIDEO_PATH.format(episode_chunk=0, video_key="{k}", episode_index=0)}
        features = dict(self.features)
        for key in self.video_keys:
            path = os.path.join(self.root, first_video[self.version].replace("{k}", key))
            features[key] = dict(features[key], info=video_info(path))
        features.update(DEFAULT_FEATURES)
        info = {"codebase_version": self.version, "robot_type": self.robot_type,
                "total_episodes": len(self.episodes), "total_frames": self.total_frames,
                "total_tasks": len(self.tasks), "chunks_size": self.chunks_size, "fps": self.fps,
                "splits": {"train": f"0:{len(self.episodes)}"}, "features": features}
        if self.version == "v3.0":
            info.update({"data_files_size_in_mb": 100, "video_files_size_in_mb": 200,
                         "data_path": V30_DATA_PATH, "video_path": V30_VIDEO_PATH if self.video_keys else None})
            self._write_v30_meta()
        else:
            info.update({"total_chunks": (len(self.episodes) - 1) // self.chunks_size + 1,
                         "total_videos": len(self.episodes) * len(self.video_keys),
                         "data_path": V21_DATA_PATH, "video_path": V21_VIDEO_PATH if self.video_keys else None})
            self._write_v21_meta()
        self._write_json("meta/info.json", info)
        self._write_json("meta/stats.json", self._global_stats())

    def _global_stats(self) -> dict[str, dict[str, Any]]:
        # cameras: of every episode's sampled pixels together; numeric features: pooled from per-episode moments
        stats: dict[str, dict[str, Any]] = {}
        for key in self.features:
            if key in self._camera_hist:
                stats[key] = stats_from_histogram(self._camera_hist[key], self._camera_frames[key])
                continue
            per = [ep["stats"][key] for ep in self.episodes]
            counts = np.array([p["count"][0] for p in per], dtype=np.float64)[:, None]
            means = np.array([p["mean"] for p in per])
            mean = (counts * means).sum(0) / counts.sum()
            var = (counts * (np.array([p["std"] for p in per]) ** 2 + (means - mean) ** 2)).sum(0) / counts.sum()
            stats[key] = {"min": np.min([p["min"] for p in per], 0).tolist(),
                          "max": np.max([p["max"] for p in per], 0).tolist(),
                          "mean": mean.tolist(), "std": np.sqrt(var).tolist(), "count": [int(counts.sum())]}
        return stats

    def _write_v30_meta(self) -> None:
        write_tasks_parquet(os.path.join(self.root, "meta", "tasks.parquet"), self.tasks)
        rows = []
        for ep in self.episodes:
            row = {k: v for k, v in ep.items() if k != "stats"}
            row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
            for key, stats in ep["stats"].items():
                for name, value in stats.items():
                    row[f"stats/{key}/{name}"] = value
            rows.append(row)
        path = os.path.join(self.root, V30_EPISODES_PATH.format(chunk_index=0, file_index=0))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), path)

    def _write_v21_meta(self) -> None:
        with open(os.path.join(self.root, "meta", "tasks.jsonl"), "w") as f:
            for i, task in enumerate(self.tasks):
                f.write(json.dumps({"task_index": i, "task": task}) + "\n")
        with open(os.path.join(self.root, "meta", "episodes.jsonl"), "w") as f:
            for ep in self.episodes:
                f.write(json.dumps({"episode_index": ep["episode_index"], "tasks": ep["tasks"],
                                    "length": ep["length"]}) + "\n")
        with open(os.path.join(self.root, "meta", "episodes_stats.jsonl"), "w") as f:
            for ep in self.episodes:
                f.write(json.dumps({"episode_index": ep["episode_index"], "stats": ep["stats"]}) + "\n")

    def _write_json(self, relpath: str, obj: Any) -> None:  # obj: a JSON document
        with open(os.path.join(self.root, relpath), "w") as f:
            json.dump(obj, f, indent=2)
