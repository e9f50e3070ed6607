"""Read LeRobot v2.1 and v3.0 folders directly (pyarrow for parquet; frames come later from PyAV).

Where the two versions differ (episode metadata, tasks, which file holds an episode's rows and
frames) is one layout object per version, `V30Layout` and `V21Layout`; the rest is shared.
Every parquet file goes through `read_parquet`.

Only the state, action, timestamp, frame_index, episode_index and task_index columns are
read up front; frames of an episode are its rows sorted by `frame_index`. Cameras are video
features (mp4, decoded by PyAV at the frame's timestamp) or image features (PNG bytes inside
the parquet, as LeRobot writes with use_videos=False), read per sample.
"""
import glob
import io
import json
import os
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from data.episodes import Episode
from data.errors import DataError


def read_info(root: str) -> dict[str, Any]:
    path = os.path.join(root, "meta", "info.json")
    if not os.path.isfile(path):
        raise DataError(f"{root} is not a LeRobot dataset: {path} does not exist")
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    for key in ("codebase_version", "fps", "features"):
        if key not in info:
            raise DataError(f"{path} has no '{key}' field")
    return info


def layout_of(root: str, info: dict[str, Any]) -> "V30Layout | V21Layout":
    """The layout object of the folder's format version."""
    version = str(info["codebase_version"])
    for prefix, layout in (("v3", V30Layout), ("v2", V21Layout)):
        if version.startswith(prefix):
            return layout(root, info)
    raise DataError(f"LeRobot codebase_version {version!r} is not supported; expected v2.x or v3.x")


def camera_keys(info: dict[str, Any]) -> list[str]:
    """Every camera feature in info.json order: videos, and images stored inside the parquet files."""
    return [k for k, f in info["features"].items() if f.get("dtype") in ("video", "image")]


class ParquetImages:
    """Frames of image features (PNG/JPEG bytes per row of a data file), read per sample.

    The column of the last few files is kept: consecutive samples mostly read the same file,
    and a column is at most the file's size (100 MB by LeRobot's default). The dataset object
    owns one; a forked DataLoader worker starts from a copy of its parent's (plain memory, no
    open file), and pickling (spawned workers) leaves the columns behind.
    """

    LIMIT = 2

    def __init__(self) -> None:
        self._columns: OrderedDict = OrderedDict()  # (file, key) -> arrow column of encoded frames

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]  # a worker's copy starts with no open files

    def _column(self, path: str, key: str) -> pa.Array:
        if (path, key) not in self._columns:
            self._columns[(path, key)] = read_parquet(path, _require([key], path)).column(key).combine_chunks()
            while len(self._columns) > self.LIMIT:
                self._columns.popitem(last=False)
        self._columns.move_to_end((path, key))
        return self._columns[(path, key)]

    def read(self, path: str, key: str, rows: Sequence[int]) -> np.ndarray:
        """uint8 [len(rows), H, W, 3] of image feature `key` at `rows` of data file `path`."""
        column = self._column(path, key)
        frames = []
        for r in rows:
            item = column[int(r)].as_py()
            blob = item.get("bytes") if isinstance(item, dict) else item
            try:
                frames.append(np.asarray(Image.open(io.BytesIO(blob)).convert("RGB")))  # type: ignore[arg-type]
            except Exception as e:  # PIL raises several types for undecodable bytes
                raise DataError(f"{path}: image '{key}' in row {int(r)} cannot be decoded: {e}") from None
        return np.stack(frames)


def feature_dim(info: dict[str, Any], key: str, root: str) -> int:
    feature = info["features"].get(key)
    if feature is None:
        names = sorted(k for k, f in info["features"].items() if f.get("dtype") not in ("video", "image"))
        raise DataError(f"{root}/meta/info.json has no feature '{key}'; numeric features: {names}")
    return int(np.prod(feature["shape"]))


def column_to_array(column: Any, key: str, path: str) -> np.ndarray:
    """A parquet column of vectors or scalars as a float32 [rows, dim] array."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type) or \
            pa.types.is_large_list(column.type):
        if column.null_count:
            raise DataError(f"{path}: column '{key}' has {column.null_count} null rows")
        if pa.types.is_fixed_size_list(column.type):
            dim = column.type.list_size
        else:
            lengths = np.diff(np.asarray(column.offsets))
            if len(lengths) and (lengths != lengths[0]).any():
                raise DataError(f"{path}: column '{key}' has rows of different lengths {sorted(set(lengths))}")
            dim = int(lengths[0]) if len(lengths) else 0
        values = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.float32)
        return values.reshape(len(column), dim)
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, 1)


def read_parquet(path: str, select: Callable[[list[str]], list[str]] | None = None) -> pa.Table:
    """The pyarrow table of `path` with the columns `select(names)` picks from its schema (all when
    None); DataError naming the file when it is missing or cannot be read."""
    if not os.path.isfile(path):
        raise DataError(f"parquet file {path} does not exist")
    try:
        names = pq.read_schema(path).names
        return pq.read_table(path, columns=names if select is None else select(names))
    except DataError:
        raise
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"parquet file {path} cannot be read: {e}") from None


def _require(wanted: Sequence[str], path: str,
             optional: Sequence[str] = ()) -> Callable[[list[str]], list[str]]:
    """A column selector for `read_parquet`: every `wanted` column (DataError when one is missing)
    and those of `optional` the file has."""
    def select(names: list[str]) -> list[str]:
        missing = [k for k in wanted if k not in names]
        if missing:
            raise DataError(f"parquet file {path} has no column {missing}; it has {names}")
        return list(wanted) + [k for k in optional if k in names]
    return select


def read_columns(path: str, wanted: Sequence[str], optional: Sequence[str] = ()) -> dict[str, Any]:
    """{name: arrow column} of a parquet file: `wanted` ones and those of `optional` present."""
    table = read_parquet(path, _require(wanted, path, optional))
    return {k: table.column(k) for k in table.column_names}


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist")
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise DataError(f"{path} line {n} is not valid JSON: {e}") from None
    return rows


def _is_text(arrow_type: pa.DataType) -> bool:
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or \
        pa.types.is_string_view(arrow_type)


class V30Layout:
    """LeRobot v3.0: episode metadata in meta/episodes/chunk-*/file-*.parquet, tasks in
    meta/tasks.parquet, data and video files holding many episodes."""

    def __init__(self, root: str, info: dict[str, Any]) -> None:
        self.root, self.info = root, info

    def episode_rows(self) -> list[dict[str, Any]]:
        files = sorted(glob.glob(os.path.join(self.root, "meta", "episodes", "*", "*.parquet")))
        if not files:
            raise DataError(f"{self.root}: no episode metadata under meta/episodes/chunk-*/file-*.parquet")
        rows = []
        for path in files:  # per-episode statistics are not needed here
            rows.extend(read_parquet(path, lambda names: [n for n in names if not n.startswith("stats/")]).to_pylist())
        return rows

    def tasks(self) -> dict[int, str]:
        path = os.path.join(self.root, "meta", "tasks.parquet")
        if not os.path.isfile(path):
            return {}
        table = read_parquet(path)
        # the task string is the pandas index: a column named "task" or "__index_level_0__"
        text = [n for n in table.column_names if n != "task_index" and _is_text(table.schema.field(n).type)]
        if "task_index" not in table.column_names or not text:
            raise DataError(f"{path}: expected a 'task_index' column and a task string column, "
                            f"found {table.column_names}")
        return dict(zip(table.column("task_index").to_pylist(), table.column(text[0]).to_pylist()))

    def data_path(self, row: dict[str, Any]) -> str:
        rel = self.info["data_path"].format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])
        return os.path.join(self.root, rel)

    def video(self, row: dict[str, Any], key: str) -> tuple[str, float]:
        """(mp4 path, time of the episode's first frame in it) of camera `key`."""
        rel = self.info["video_path"].format(video_key=key, chunk_index=row[f"videos/{key}/chunk_index"],
                                             file_index=row[f"videos/{key}/file_index"])
        return os.path.join(self.root, rel), float(row[f"videos/{key}/from_timestamp"])


class V21Layout:
    """LeRobot v2.1 (and v2.0): meta/episodes.jsonl, meta/tasks.jsonl, one parquet and one mp4 per
    episode under the `data_path` / `video_path` templates (`episode_chunk` = episode_index // chunks_size)."""

    def __init__(self, root: str, info: dict[str, Any]) -> None:
        self.root, self.info = root, info

    def episode_rows(self) -> list[dict[str, Any]]:
        return _read_jsonl(os.path.join(self.root, "meta", "episodes.jsonl"))

    def tasks(self) -> dict[int, str]:
        return {r["task_index"]: r["task"] for r in _read_jsonl(os.path.join(self.root, "meta", "tasks.jsonl"))}

    def _format(self, template: str, row: dict[str, Any], **fields: str) -> str:
        ep = row["episode_index"]
        rel = template.format(episode_chunk=ep // self.info.get("chunks_size", 1000), episode_index=ep, **fields)
        return os.path.join(self.root, rel)

    def data_path(self, row: dict[str, Any]) -> str:
        return self._format(self.info["data_path"], row)

    def video(self, row: dict[str, Any], key: str) -> tuple[str, float]:
        """(mp4 path, time of the episode's first frame in it: 0, one file per episode) of camera `key`."""
        return self._format(self.info["video_path"], row, video_key=key), 0.0


class LeRobotSource:
    """The episodes of one LeRobot folder."""

    def __init__(self, root: str, source: int, state_key: str | None, action_key: str,
                 image_keys: Sequence[str] | None = None, max_episodes: int | None = None) -> None:
        self.root, self.source = root, source
        self.info = read_info(root)
        self.layout = layout_of(root, self.info)
        self.fps = float(self.info["fps"])
        self.state_key, self.action_key = state_key, action_key
        available = camera_keys(self.info)
        if image_keys is None and not available:
            raise DataError(f"{root}/meta/info.json has no camera feature (dtype video or image)")
        self.image_keys = list(available if image_keys is None else image_keys)
        for key in self.image_keys:
            if key not in available:
                raise DataError(f"{root}: dataset.image_keys names '{key}', which is not a camera feature "
                                f"of meta/info.json; camera features: {available}")
        self.action_dim = feature_dim(self.info, action_key, root)
        self.state_dim = feature_dim(self.info, state_key, root) if state_key else None
        self.tasks = self.layout.tasks()
        self.rows = sorted(self.layout.episode_rows(), key=lambda r: r["episode_index"])
        if max_episodes is not None:
            self.rows = self.rows[:max_episodes]
        self.episode_indices = [int(r["episode_index"]) for r in self.rows]

    def _wanted(self) -> tuple[list[str], tuple[str, ...]]:
        wanted = [self.action_key] + ([self.state_key] if self.state_key else [])
        return wanted, ("timestamp", "frame_index", "episode_index", "task_index")

    def load(self, on_bad: Callable[[str], None]) -> list[Episode]:
        """Episodes of this folder. `on_bad(message)` gets each unreadable episode; it raises to stop."""
        groups: dict = {}
        for row in self.rows:
            groups.setdefault(self.layout.data_path(row), []).append(row)
        episodes = []
        for path, rows in groups.items():
            try:
                columns = read_columns(path, *self._wanted())
            except DataError as e:
                for row in rows:
                    on_bad(f"episode {row['episode_index']} of {self.root}: {e}")
                continue
            rows_of = self._rows_by_episode(columns)
            for row in rows:
                try:
                    episodes.append(self._episode(row, columns, path, rows_of(int(row["episode_index"]))))
                except DataError as e:
                    on_bad(str(e))
        return episodes

    @staticmethod
    def _rows_by_episode(columns: Mapping[str, pa.ChunkedArray]) -> Callable[[int], np.ndarray]:
        """episode index -> its row numbers in the file, in frame order (one sort per file)."""
        if "episode_index" not in columns:  # v2.1 files hold one episode
            every = np.arange(len(next(iter(columns.values()))))
            return lambda ep: every
        episode = np.asarray(columns["episode_index"].to_numpy())
        frame = np.asarray(columns["frame_index"].to_numpy()) if "frame_index" in columns else np.arange(len(episode))
        order = np.lexsort((frame, episode))
        sorted_eps = episode[order]
        return lambda ep: order[np.searchsorted(sorted_eps, ep, "left"):np.searchsorted(sorted_eps, ep, "right")]

    def _episode(self, row: dict[str, Any], columns: Mapping[str, pa.ChunkedArray], path: str,
                 rows: np.ndarray) -> Episode:
        ep = int(row["episode_index"])
        where = f"episode {ep} of {path}"
        length = int(row.get("length", len(rows)))
        if len(rows) != length:
            raise DataError(f"{where}: {len(rows)} rows in the data file, the episode metadata says {length}")
        take = pa.array(rows)
        action = self._numeric(columns, self.action_key, take, self.action_dim, where)
        state = self._numeric(columns, self.state_key, take, self.state_dim, where) if self.state_key else None
        if "timestamp" in columns:
            timestamps = np.asarray(columns["timestamp"].take(take).to_numpy(), dtype=np.float64)
        else:
            timestamps = np.arange(length) / self.fps
        task_names = row.get("tasks") or []
        if "task_index" in columns:
            task_index = np.asarray(columns["task_index"].take(take).to_numpy(), dtype=np.int64)
            unknown = sorted(set(task_index.tolist()) - set(self.tasks))
            if unknown and not task_names:
                raise DataError(f"{where}: task_index {unknown} not in the dataset's tasks")
            codes = sorted(set(task_index.tolist()))
            tasks = [self.tasks.get(t, task_names[0] if task_names else "") for t in codes]
            task_ids = np.asarray(np.searchsorted(codes, task_index))
        else:
            tasks, task_ids = [task_names[0] if task_names else ""], np.zeros(length, dtype=np.int64)
        videos, images = {}, {}
        for key in self.image_keys:
            if self.info["features"][key]["dtype"] == "image":
                images[key] = (path, rows)
                continue
            video_path, start = self.layout.video(row, key)
            if not os.path.isfile(video_path):
                raise DataError(f"{where}: video file {video_path} ({key}) does not exist")
            videos[key] = (video_path, start)
        return Episode(source=self.source, index=ep, length=length, action=action, state=state,
                       timestamps=timestamps, task_ids=task_ids, tasks=tasks, videos=videos, images=images,
                       fps=self.fps, origin=path)

    @staticmethod
    def _numeric(columns: Mapping[str, pa.ChunkedArray], key: str, take: pa.Array, dim: int | None,
                 where: str) -> np.ndarray:
        values = column_to_array(columns[key].take(take), key, where)
        if values.shape[1] != dim:
            raise DataError(f"{where}: '{key}' has dimension {values.shape[1]}, meta/info.json says {dim}")
        bad = ~np.isfinite(values)
        if bad.any():
            frame = int(np.nonzero(bad.any(1))[0][0])
            raise DataError(f"{where}: '{key}' has {int(bad.sum())} NaN/inf values (first at frame {frame})")
        return values
