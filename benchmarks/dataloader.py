"""Data loading throughput: LeRobot from mp4 vs from the latent cache, compute_stats time, and a race
against LeRobot's own `LeRobotDataset` on an existing folder.

    python benchmarks/dataloader.py [--quick] [--workers 2] [--out benchmarks/results/dataloader.json]
    python benchmarks/dataloader.py --lerobot-dir DIR [--num-video-frames 8 --global-downsample-rate 3
        --video-action-freq-ratio 2 --video-height 384 --video-width 320] [--windows 48 --rounds 3 --workers 2]

With --lerobot-dir (see `race_official` below) nothing is generated: the folder is read as it is.
Without it:

generates a LeRobot v3.0 dataset (AV1, LeRobot's encoder settings) of squares moved by actions,
then measures, in one process run and side by side:
- samples/s of the train stream decoding mp4 (Motus geometry: 384 x 320, F = 8, d = 3, r = 2),
  with the loading in the main process (one worker) and with `--workers` DataLoader workers
  (reported per worker);
- the same through a latent cache holding full-size shapes (Wan2.2 latents 48 x 3 x 24 x 20,
  umT5 text 512 x 4096 per instruction, 256 x 2048 VLM features per window; a fake encoder
  fills them, so only loading is timed);
- compute_stats over the parquet columns, on this dataset and on a camera-less one of
  100,000 frames (20,000 with --quick) of 14-dim state and action.
The synthetic frames are flat colours, so AV1 decoding here is cheaper than on camera footage.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data import build_datasets, build_train_stream  # noqa: E402
from data.build_cache import build_cache  # noqa: E402
from data.compute_stats import compute_stats  # noqa: E402
from data.lerobot_writer import LeRobotWriter  # noqa: E402
from data.synthetic import generate  # noqa: E402
from benchmarks.lerobot_official import add_race_arguments, race_official  # noqa: E402
from utils.batch import DataBatch, ModelBatch  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


class FullSizeFakeEncoders:
    """Outputs with the full model's shapes, cheaply (the cache is what is measured, not the encoders)."""

    def encode(self, batch: DataBatch) -> ModelBatch:
        b = batch.video.shape[0]
        pooled = F.adaptive_avg_pool3d(batch.video.permute(0, 2, 1, 3, 4), (3, 24, 20))  # [B, 3, 3, 24, 20]
        text_mask = torch.zeros(b, 512, dtype=torch.bool)
        text_mask[:, :12] = True
        return ModelBatch(video_latents=pooled.repeat(1, 16, 1, 1, 1),  # [B, 48, 3, 24, 20]
                          text_embeds=torch.zeros(b, 512, 4096), text_mask=text_mask,
                          vlm_features=torch.randn(b, 256, 2048), vlm_mask=torch.ones(b, 256, dtype=torch.bool),
                          state=batch.state, actions=batch.actions)


def numeric_dataset(folder, episodes, length, dim=14):
    """A LeRobot v3.0 folder with 14-dim state and action and no camera: compute_stats at scale."""
    root = os.path.join(folder, "numeric")
    features = {k: {"dtype": "float32", "shape": [dim], "names": None} for k in ("observation.state", "action")}
    writer = LeRobotWriter(root, 30, features, episodes_per_file=50)
    rng = np.random.default_rng(0)
    for _ in range(episodes):
        values = np.cumsum(rng.normal(size=(length, dim)), axis=0).astype(np.float32)
        writer.add_episode({"observation.state": values, "action": values}, "reach")
    writer.close()
    return root, episodes * length


def make_cfg(folder, root, workers, cache_dir=None):
    base = {"common": {"action_dim": 4, "state_dim": 8, "num_video_frames": 8, "video_height": 384,
                       "video_width": 320, "global_downsample_rate": 3, "video_action_freq_ratio": 2},
            "dataset": {"type": "lerobot", "dataset_dir": root, "val_fraction": 0.0, "cache_dir": cache_dir,
                        "cache_stride": 12},
            "training": {"batch_size": 4, "seed": 0}, "system": {"num_workers": workers, "pin_memory": False}}
    path = os.path.join(folder, f"cfg_{workers}_{cache_dir is not None}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(base, f)
    from recipe.config import load_config
    return load_config(path)


def samples_per_second(cfg, batches):
    train, _, _ = build_datasets(cfg)
    stream = build_train_stream(train, cfg)
    next(stream)  # workers started, files opened
    start = time.perf_counter()
    for _ in range(batches):
        next(stream)
    elapsed = time.perf_counter() - start
    stream.close()
    return batches * cfg.training.batch_size / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small dataset, few batches (about a minute)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file to write; default benchmarks/results/"
                        "dataloader.json, or dataloader_lerobot.json with --lerobot-dir")
    add_race_arguments(parser)
    args = parser.parse_args()
    name = "dataloader_lerobot.json" if args.lerobot_dir else "dataloader.json"
    args.out = args.out or os.path.join("benchmarks", "results", name)
    if args.lerobot_dir:
        return race_official(args)
    size = dict(num_episodes=4, episode_length=120, image_height=240, image_width=320) if args.quick else \
        dict(num_episodes=12, episode_length=300, image_height=480, image_width=640)
    batches = 5 if args.quick else 25
    folder = tempfile.mkdtemp(prefix="bench_data_")
    root = os.path.join(folder, "lerobot")
    start = time.perf_counter()
    generate(root, fps=30, seed=0, **size)
    generate_s = time.perf_counter() - start
    frames = size["num_episodes"] * size["episode_length"]

    start = time.perf_counter()
    compute_stats([root])
    stats_s = time.perf_counter() - start
    big_root, big_frames = numeric_dataset(folder, episodes=40 if args.quick else 200, length=500)
    start = time.perf_counter()
    compute_stats([big_root])
    big_stats_s = time.perf_counter() - start

    rows = []
    for workers in (0, args.workers):
        rate = samples_per_second(make_cfg(folder, root, workers), batches)
        rows.append(("mp4 (AV1)", workers, rate, rate / max(workers, 1)))
    start = time.perf_counter()
    cache_dir = os.path.join(folder, "cache")
    meta = build_cache(make_cfg(folder, root, 0), cache_dir, FullSizeFakeEncoders(), batch_size=4)
    cache_s = time.perf_counter() - start
    for workers in (0, args.workers):
        rate = samples_per_second(make_cfg(folder, root, workers, cache_dir), batches)
        rows.append(("latent cache", workers, rate, rate / max(workers, 1)))

    print(f"dataset: {size['num_episodes']} episodes x {size['episode_length']} frames "
          f"({frames} frames, {size['image_height']}x{size['image_width']} AV1), generated in {generate_s:.1f}s")
    print(f"compute_stats: {stats_s:.2f}s on this dataset; {big_stats_s:.2f}s on {big_frames:,} frames of "
          f"14-dim state + action ({big_frames / big_stats_s:,.0f} frames/s, parquet only, no video decoded)")
    print(f"build_cache (fake encoder, {meta['num_windows']} windows): {cache_s:.1f}s")
    print(f"{'source':<14}{'workers':>8}{'samples/s':>12}{'per worker':>12}")
    for source, workers, rate, per in rows:
        print(f"{source:<14}{workers if workers else 'main':>8}{rate:>12.1f}{per:>12.1f}")
    mp4, cache = rows[0][2], rows[2][2]
    print(f"cache / mp4 (main process): {cache / mp4:.1f}x")
    result = {"quick": args.quick, "dataset": {**size, "frames": frames, "codec": "libsvtav1"},
              "generate_s": generate_s, "compute_stats_s": stats_s,
              "compute_stats_large": {"frames": big_frames, "dims": 14, "seconds": big_stats_s},
              "build_cache_s": cache_s,
              "throughput": [{"source": s, "workers": w, "samples_per_s": r, "samples_per_s_per_worker": p}
                             for s, w, r, p in rows],
              "cache_over_mp4": cache / mp4}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
