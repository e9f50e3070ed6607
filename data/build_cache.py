"""Precompute VAE latents and text embeddings (and VLM features) so training skips the frozen encoders.

    python -m data.build_cache --config configs/tiny.yaml --out cache/tiny [key=value ...]

Every episode (train and validation) contributes windows at condition frames 0, s, 2s, ...
(s = dataset.cache_stride, default r * d). Windows go through `encoders.encode` (the model
part's FrozenEncoders) in batches; the outputs are stored per window in safetensors shards
(see data/cache.py for the layout). Then set `dataset.cache_dir` to the output folder.
"""
import argparse
import json
import logging
import os
import shutil
import sys
import time
from typing import Any

import torch
from omegaconf import DictConfig
from safetensors.torch import save_file

from data.build import BadEpisodes, load_episodes
from data.cache import META_FILE, ROW_KEYS, TEXT_FILE, cache_stride, fingerprint, fingerprint_parts
from data.dataset import EpisodeDataset, try_load
from data.episodes import WindowSpec
from data.errors import DataError
from data.normalize import NormStats
from data.stream import collate
from utils.batch import DataBatch, ModelBatch

logger = logging.getLogger(__name__)
PROGRESS_SECONDS = 30.0  # one progress line this often: a stride-1 cache of 50 episodes is ~7600 windows
ROW_TENSORS = ("video_latents", "vlm_features", "vlm_mask")  # per window; text is per instruction


def cache_windows(dataset: EpisodeDataset, stride: int) -> list[tuple[int, int]]:
    return [(i, c) for i, e in enumerate(dataset.episodes) for c in range(0, dataset.spec.num_windows(e.length), stride)]


class _ShardWriter:
    pending: list[dict[str, Any]]  # rows not yet in a shard
    shards: list[dict[str, Any]]  # meta.json's entry of each shard written
    keys: list[str]

    def __init__(self, out: str, rows_per_shard: int) -> None:
        self.out, self.rows_per_shard = out, rows_per_shard
        self.pending, self.shards, self.vlm_len, self.keys = [], [], 0, []

    def add(self, rows: list[dict[str, Any]]) -> None:
        self.pending += rows
        while len(self.pending) >= self.rows_per_shard:
            self._write(self.pending[:self.rows_per_shard])
            self.pending = self.pending[self.rows_per_shard:]

    def close(self) -> None:
        if self.pending:
            self._write(self.pending)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        self.keys = [k for k in ROW_TENSORS if k in rows[0]]
        tensors = {}
        for key in (k for k in rows[0] if k not in ROW_KEYS):
            values = [r[key] for r in rows]
            if key in ("vlm_features", "vlm_mask"):  # trimmed per row; pad to this shard's longest
                longest = max(v.shape[0] for v in values)
                self.vlm_len = max(self.vlm_len, longest)
                values = [torch.nn.functional.pad(v, (0, 0, 0, longest - v.shape[0]) if v.dim() == 2
                                                  else (0, longest - v.shape[0])) for v in values]
            tensors[key] = torch.stack(values).contiguous()
        name = f"shard-{len(self.shards):05d}.safetensors"
        index = [[int(r[k]) for k in ROW_KEYS] for r in rows]
        save_file(tensors, os.path.join(self.out, name))
        self.shards.append({"file": name, "rows": len(rows), "index": index})


class _Texts:
    """One text embedding per distinct instruction (a full-size one is 512 x 4096 floats)."""

    index: dict[str, int]  # instruction -> its row
    embeds: list[torch.Tensor]
    masks: list[torch.Tensor]

    def __init__(self) -> None:
        self.index, self.embeds, self.masks = {}, [], []

    def add(self, instruction: str, embeds: torch.Tensor, mask: torch.Tensor) -> int:
        if instruction not in self.index:
            self.index[instruction] = len(self.embeds)
            self.embeds.append(embeds.detach().cpu().float())
            self.masks.append(mask.detach().cpu().bool())
        return self.index[instruction]

    def save(self, path: str) -> None:
        save_file({"text_embeds": torch.stack(self.embeds), "text_mask": torch.stack(self.masks)}, path)


def _rows(batch: DataBatch, encoded: ModelBatch, windows: list[tuple[int, int]], dataset: EpisodeDataset,
          texts: _Texts) -> list[dict[str, Any]]:
    rows = []
    assert batch.instruction is not None and batch.actions is not None  # a raw dataset's batch holds both
    for b, (i, c) in enumerate(windows):
        row = {"source": dataset.episodes[i].source, "episode_index": dataset.episodes[i].index, "frame_index": c,
               "text_index": texts.add(batch.instruction[b], encoded.text_embeds[b], encoded.text_mask[b]),
               "actions": batch.actions[b].float()}
        if batch.state is not None:
            row["state"] = batch.state[b].float()
        for key in ROW_TENSORS:
            value = getattr(encoded, key)
            if value is None:
                continue
            value = value[b].detach().cpu()
            row[key] = value.bool() if key.endswith("_mask") else value.float()
        if "vlm_features" in row and "vlm_mask" not in row:  # encode gives no mask for an unpadded batch
            row["vlm_mask"] = torch.ones(row["vlm_features"].shape[0], dtype=torch.bool)
        if "vlm_mask" in row:
            length = int(row["vlm_mask"].sum())
            row["vlm_features"], row["vlm_mask"] = row["vlm_features"][:length], row["vlm_mask"][:length]
        rows.append(row)
    return rows


def build_cache(cfg: DictConfig, out: str, encoders: Any, batch_size: int = 8, rows_per_shard: int = 512) -> dict[str, Any]:
    """Write the cache of `cfg`'s dataset to `out` with `encoders` (anything with `encode(batch)`)."""
    dcfg = cfg.dataset
    if dcfg.type == "synthetic":
        from data.synthetic import ensure_synthetic
        ensure_synthetic(cfg)
    episodes, image_keys, _ = load_episodes(dcfg, BadEpisodes(dcfg.skip_bad_samples))
    parts = fingerprint_parts(cfg, episodes)
    raw = NormStats({}, mode="none")  # the cache keeps robot units; statistics apply when read
    dataset = EpisodeDataset(episodes, WindowSpec.from_config(cfg), image_keys, cfg.common.video_height,
                             cfg.common.video_width, raw, dcfg.instruction, frame_layout=dcfg.frame_layout)
    windows = cache_windows(dataset, cache_stride(cfg))
    if not windows:
        raise DataError("no episode is long enough for one window; nothing to cache")
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    writer, texts, start = _ShardWriter(tmp, rows_per_shard), _Texts(), time.perf_counter()
    skipped: list = []
    logged = start - PROGRESS_SECONDS  # the first batch is logged: the user sees the count at once
    for first in range(0, len(windows), batch_size):
        good, samples = [], []
        for window in windows[first:first + batch_size]:
            sample = try_load(dataset, window, dcfg.skip_bad_samples, skipped)
            if sample is None:
                logger.warning("build_cache: skipping %s", skipped[-1])
                continue
            sample.pop("_bad")
            samples.append(sample)
            good.append(window)
        if not samples:
            continue
        batch = collate(samples)
        with torch.no_grad():
            encoded = encoders.encode(batch)
        writer.add(_rows(batch, encoded, good, dataset, texts))
        now, done = time.perf_counter(), first + len(good)
        if now - logged >= PROGRESS_SECONDS or first + batch_size >= len(windows):
            rate = done / max(now - start, 1e-9)
            logger.info("build_cache: %d / %d windows, %.1f a second, %.0f s left", done, len(windows), rate,
                        (len(windows) - done) / rate)
            logged = now
    writer.close()
    texts.save(os.path.join(tmp, TEXT_FILE))
    meta = {"version": 1, "fingerprint": fingerprint(parts), "parts": parts, "shards": writer.shards,
            "keys": writer.keys, "has_state": any(e.state is not None for e in episodes), "vlm_len": writer.vlm_len,
            "num_windows": sum(s["rows"] for s in writer.shards), "skipped": skipped,
            "seconds": round(time.perf_counter() - start, 2)}
    with open(os.path.join(tmp, META_FILE), "w") as f:
        json.dump(meta, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)  # a cache folder is complete or absent
    return meta


def cache_encoders(cfg: DictConfig, device: str | torch.device) -> Any:
    """Every frozen part, whatever `dataset.cache_dir` says: the windows are raw (and cache_dir may
    name the very cache being built, which would otherwise leave umT5 and Qwen3-VL out)."""
    from models import build_world_model
    from models.build import ALL_FROZEN_PARTS

    _, encoders = build_world_model(cfg, frozen_parts=ALL_FROZEN_PARTS)
    return encoders.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from models.serialization import ModelLoadError
    from recipe.config import load_config
    from recipe.generated import ensure_generated_inputs
    from utils.config import ConfigError

    try:
        cfg = load_config(args.config, args.overrides)
        ensure_generated_inputs(cfg)  # the cache must come from the frozen parts training will use
        meta = build_cache(cfg, args.out, cache_encoders(cfg, args.device), args.batch_size)
    except (ConfigError, DataError, ModelLoadError) as e:
        sys.exit(f"build_cache failed: {e}")
    print(f"wrote {meta['num_windows']} windows to {args.out} in {meta['seconds']}s "
          f"({len(meta['skipped'])} bad windows skipped); set dataset.cache_dir: {args.out}")


if __name__ == "__main__":
    main()
