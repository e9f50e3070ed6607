"""The latent cache: VAE latents, text embeddings (and VLM features) precomputed per window.

Layout of a cache folder (written by `python -m data.build_cache`):

    cache_meta.json            fingerprint, what it was built from, shards with each row's
                               (source, episode_index, frame_index, text_index), vlm_len; written last
    texts.safetensors          text_embeds [U, Lt, D] + text_mask [U, Lt], one per distinct instruction
    shard-00000.safetensors    per window (row): video_latents [C, T, h, w], vlm_features [Lv, Dv] +
                               vlm_mask [Lv] (if the model has a VLM; padded to the shard's longest),
                               state and actions in robot units (normalised when read, so the
                               statistics may change)

The fingerprint hashes the dataset (type, folders, keys, window geometry, every episode's length)
and the encoder-relevant model config (size, precision, VAE / text encoder / VLM paths, the tiny
VAE's fit when it is not the default). A cache
whose fingerprint differs from the current config is refused, naming the fields that differ.
"""
import hashlib
import json
import os
from typing import Any, Collection, Sequence

import numpy as np
import torch
from omegaconf import DictConfig
from safetensors import safe_open

from data.episodes import Episode
from data.errors import DataError
from data.normalize import NormStats
from models.config import TinyVAEFitConfig

META_FILE = "cache_meta.json"
TEXT_FILE = "texts.safetensors"
ROW_KEYS = ("source", "episode_index", "frame_index", "text_index")


def cache_stride(cfg: DictConfig) -> int:
    c = cfg.common
    return cfg.dataset.cache_stride or c.video_action_freq_ratio * c.global_downsample_rate


def fingerprint_parts(cfg: DictConfig, episodes: Sequence[Episode]) -> dict[str, Any]:
    """{"dataset": {...}, "model": {...}}: everything a cached window depends on."""
    d, c, m = cfg.dataset, cfg.common, cfg.model
    dirs = d.dataset_dir if not isinstance(d.dataset_dir, str) else [d.dataset_dir]
    absolute = lambda p: os.path.abspath(p) if p else None  # noqa: E731
    lengths = [[e.source, e.index, e.length] for e in sorted(episodes, key=lambda e: (e.source, e.index))]
    dataset = {
        "type": d.type, "dataset_dir": [absolute(str(p)) for p in dirs],
        "image_keys": list(d.image_keys) if d.image_keys is not None else None,
        "state_key": d.state_key, "action_key": d.action_key, "instruction": d.instruction,
        "data_mode": d.data_mode, "task_mode": d.task_mode, "task_name": d.task_name,
        "cache_stride": cache_stride(cfg), "num_video_frames": c.num_video_frames,
        "video_height": c.video_height, "video_width": c.video_width,
        "global_downsample_rate": c.global_downsample_rate, "video_action_freq_ratio": c.video_action_freq_ratio,
        "episodes_sha256": hashlib.sha256(json.dumps(lengths).encode()).hexdigest(),
    }
    if d.frame_layout != "tile":  # named only when set, so caches built before the key existed stay valid
        dataset["frame_layout"] = d.frame_layout
    if d.pad_episode_end:
        dataset["pad_episode_end"] = True
    model = {"size": m.size, "precision": m.precision, "vae_path": absolute(m.wan.vae_path),
             "text_encoder_path": absolute(m.wan.text_encoder_path), "vlm_path": absolute(m.vlm.checkpoint_path)}
    # a generated tiny VAE is refitted in place when the recipe's fit changes: the same path, other latents
    fit = TinyVAEFitConfig(**m.tiny_vae_fit).record()
    if m.size == "tiny" and fit is not None:
        model["tiny_vae_fit"] = fit
    return {"dataset": dataset, "model": model}


def fingerprint(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def read_meta(cache_dir: str) -> dict[str, Any]:
    path = os.path.join(cache_dir, META_FILE)
    if not os.path.isfile(path):
        raise DataError(f"dataset.cache_dir {cache_dir} holds no complete cache ({META_FILE} is missing); "
                        "build it with `python -m data.build_cache --config <yaml> --out <dir>`")
    with open(path) as f:
        return json.load(f)


def check_fingerprint(meta: dict[str, Any], parts: dict[str, Any], cache_dir: str) -> None:
    if meta.get("fingerprint") == fingerprint(parts):
        return
    diffs = []
    for section, want in parts.items():
        have = meta.get("parts", {}).get(section, {})
        for key in sorted(set(want) | set(have)):
            if want.get(key) != have.get(key):
                diffs.append(f"{section}.{key}: cache {have.get(key)!r}, config {want.get(key)!r}")
    raise DataError(f"the cache in {cache_dir} was built for another dataset or model config; it is refused. "
                    "Differences: " + "; ".join(diffs or ["format version"])
                    + ". Rebuild it with `python -m data.build_cache` or set dataset.cache_dir: null")


class _Shards:
    """safetensors shards opened lazily, once per process (DataLoader workers fork)."""

    _open: dict[int, Any]  # shard -> its safetensors handle (safe_open)
    _pid: int | None  # the process that opened them

    def __init__(self, cache_dir: str, files: Sequence[str]) -> None:
        self.paths = [os.path.join(cache_dir, f) for f in files]
        self._open, self._pid = {}, None

    def get(self, shard: int, key: str, row: int) -> torch.Tensor:
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()
        path = self.paths[shard]
        try:
            if shard not in self._open:
                self._open[shard] = safe_open(path, framework="pt")
            return self._open[shard].get_slice(key)[row:row + 1][0]
        except (OSError, RuntimeError, ValueError) as e:  # safetensors reports a damaged file this way
            self._open.pop(shard, None)
            raise DataError(f"cache shard {path} cannot be read ({key}, row {row}): {e}") from None


class CachedDataset:
    """Windows read from a latent cache instead of decoded and encoded every step (a WindowSource,
    utils/window_source.py, whose windows are row numbers)."""

    def __init__(self, cache_dir: str, cfg: DictConfig, stats: NormStats, episodes: Sequence[Episode],
                 keep: Collection[tuple[str, int]],
                 source_weights: Sequence[float] | None = None) -> None:
        meta = read_meta(cache_dir)
        check_fingerprint(meta, fingerprint_parts(cfg, episodes), cache_dir)
        self.stats, self.vlm_len, self.keys = stats, meta.get("vlm_len"), meta["keys"]
        self.has_state = meta["has_state"]
        self.shards = _Shards(cache_dir, [s["file"] for s in meta["shards"]])
        self.rows = []  # (shard, row, source, episode_index, frame_index) of the kept episodes
        for shard, info in enumerate(meta["shards"]):
            index = np.asarray(info["index"], dtype=np.int64).reshape(-1, len(ROW_KEYS))
            self.rows += [(shard, r, *map(int, index[r])) for r in range(len(index))
                          if (int(index[r][0]), int(index[r][1])) in keep]
        self.text_path = os.path.join(cache_dir, TEXT_FILE)
        self._texts: tuple[torch.Tensor, torch.Tensor] | None = None
        self.sources = sorted({r[2] for r in self.rows})
        self._by_source = {s: [i for i, r in enumerate(self.rows) if r[2] == s] for s in self.sources}
        w = [len(self._by_source[s]) if source_weights is None else source_weights[s] for s in self.sources]
        self.source_probs = np.asarray(w, dtype=np.float64) / max(sum(w), 1e-12)
        self.bad_episodes: list[str] = []  # the unreadable episodes left out, set by data/build.py

    def __len__(self) -> int:
        return len(self.rows)

    def draw(self, rng: np.random.Generator) -> int:
        if not self.rows:
            raise DataError("the cache holds no window of the selected episodes")
        source = self.sources[rng.choice(len(self.sources), p=self.source_probs)]
        rows = self._by_source[source]
        return rows[int(rng.integers(len(rows)))]

    def val_windows(self) -> list[int]:
        return list(range(len(self.rows)))

    def describe(self, i: int) -> str:
        shard, row, source, episode, frame, _ = self.rows[i]
        return f"cached frame {frame} of episode {episode} (folder {source}, {self.shards.paths[shard]} row {row})"

    def _text(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._texts is None:  # a few distinct instructions: read them all once per process
            try:
                with safe_open(self.text_path, framework="pt") as f:
                    self._texts = (f.get_tensor("text_embeds"), f.get_tensor("text_mask"))
            except (OSError, RuntimeError, ValueError) as e:
                raise DataError(f"cache file {self.text_path} cannot be read: {e}") from None
        return self._texts[0][k], self._texts[1][k]

    def load(self, i: int) -> dict[str, Any]:
        """One sample: DataBatch's cached fields (utils/batch.py) without the batch dimension."""
        shard, row, _, episode, frame, text = self.rows[i]
        sample = {k: self.shards.get(shard, k, row) for k in self.keys}
        sample["text_embeds"], sample["text_mask"] = self._text(text)
        if "vlm_features" in sample:  # pad every row to the cache's longest so batches stack
            pad = self.vlm_len - sample["vlm_features"].shape[0]
            sample["vlm_features"] = torch.nn.functional.pad(sample["vlm_features"], (0, 0, 0, pad))
            sample["vlm_mask"] = torch.nn.functional.pad(sample["vlm_mask"], (0, pad))
        actions = self.shards.get(shard, "actions", row).numpy()
        state = self.stats.normalize_state(self.shards.get(shard, "state", row).numpy()) if self.has_state else None
        sample["actions"] = torch.from_numpy(np.array(self.stats.normalize_action(actions, state), dtype=np.float32))
        if state is not None:
            sample["state"] = torch.from_numpy(np.array(state, dtype=np.float32))
        sample["episode_index"], sample["frame_index"] = episode, frame
        return sample
