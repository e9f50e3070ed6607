"""Evaluate a checkpoint open-loop on held-out episodes and write a report.

    python -m inference.evaluate --checkpoint runs/tiny/<run> [--which best] --out eval/ [--episodes 3] \
        [--modes policy,joint,video,forward_dynamics,inverse_dynamics] [--seed 0] [--device cpu]

Every window of the held-out episodes (or of `--dataset DIR`) is one sample: the model sees the
condition frame, the state and the instruction (and, in the conditioned modes, the true actions or
video), and its prediction is scored against the recording. Writes report.json, report.md, PNG plots
and, for the first `--media` samples, true | predicted mp4s and action trajectory PNGs (TRAINING.md,
"Evaluate and deploy", says what every figure means).
"""
import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from checkpoint.finetune import WEIGHT_SETS
from checkpoint.layout import WHICH
from inference import metrics
from inference.load import CheckpointError, load_checkpoint
from inference.policy import Policy
from models.flow import ACTION_MODES, SAMPLE_MODES, VIDEO_MODES

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from data.dataset import EpisodeDataset
    from data.episodes import Episode
    from data.normalize import NormStats

log = logging.getLogger("evaluate")


def eval_dataset(cfg: "DictConfig", stats: "NormStats", dataset_dir: str | None = None) -> "EpisodeDataset":
    """The held-out episodes of the recipe's dataset (or every episode of `dataset_dir`), normalised with
    the checkpoint's statistics, as an EpisodeDataset with raw video (a latent cache is not used)."""
    from data.build import BadEpisodes, check_dims, load_episodes, split
    from data.dataset import EpisodeDataset
    from data.episodes import WindowSpec
    from data.synthetic import ensure_synthetic

    dcfg = cfg.dataset
    if dataset_dir is None:
        ensure_synthetic(cfg)
    else:
        from omegaconf import OmegaConf
        dcfg = OmegaConf.merge(dcfg, {"dataset_dir": dataset_dir})
    episodes, image_keys, _ = load_episodes(dcfg, BadEpisodes(dcfg.skip_bad_samples))
    check_dims(episodes, cfg)
    if dataset_dir is None:
        _, episodes = split(episodes, dcfg)
        if not episodes:
            raise CheckpointError("the recipe holds no episode out (dataset.val_fraction 0 and no val_episodes); "
                                  "pass --dataset DIR")
    c = cfg.common
    return EpisodeDataset(episodes, WindowSpec.from_config(cfg), image_keys, c.video_height, c.video_width,
                          stats, dcfg.instruction, frame_layout=dcfg.frame_layout)


def sample_seed(seed: int, episode: "Episode", frame: int) -> int:
    """One noise seed per sample from (--seed, source, episode, frame): independent of batching."""
    return int(np.random.SeedSequence([seed, episode.source, episode.index, frame]).generate_state(1)[0])


@torch.no_grad()
def run(policy: Policy, dataset: "EpisodeDataset", windows: list[tuple[int, int]], modes: list[str], seed: int,
        batch_size: int, num_steps: int | None = None) -> dict[str, np.ndarray]:
    """Predictions of every mode on every window, gathered on the CPU."""
    from data.stream import collate

    got: dict[str, list] = {"true_actions": [], "last_actions": [], "true_video": [], "true_latents": [], "recon": []}
    got.update({f"{m}/{k}": [] for m in modes for k in ("actions", "latents", "video")})
    for start in tqdm(range(0, len(windows), batch_size), desc="evaluate", dynamic_ncols=True):
        chunk = windows[start:start + batch_size]
        batch = collate([dataset.load(w) for w in chunk])
        seeds = [sample_seed(seed, dataset.episodes[i], c) for i, c in chunk]
        got["last_actions"].append(np.stack([metrics.last_action(dataset.episodes[i], c) for i, c in chunk]))
        assert batch.actions is not None and batch.video is not None  # a raw dataset's windows hold both
        got["true_actions"].append(policy.stats.unnormalize_action(batch.actions, batch.state).numpy())
        inputs = policy.encoders.encode(batch)  # on the model's device, the given actions and state too
        if any(m in VIDEO_MODES for m in modes):
            got["true_video"].append(batch.video.numpy())
            got["true_latents"].append(inputs.video_latents.cpu().numpy())
            got["recon"].append(policy.encoders.decode_video(inputs.video_latents).cpu().numpy())
        for mode in modes:
            out = policy.sample(inputs, seeds, mode, num_steps)
            got[f"{mode}/actions"].append(out.actions.numpy())
            if mode in VIDEO_MODES:
                got[f"{mode}/latents"].append(out.video_latents.cpu().numpy())
                got[f"{mode}/video"].append(policy.encoders.decode_video(out.video_latents).cpu().numpy())
    return {k: np.concatenate(v) for k, v in got.items() if v}


def figures(got: dict[str, np.ndarray], modes: Sequence[str], mean_action: Sequence[float]) -> dict[str, Any]:
    """Every figure of the report from the gathered predictions."""
    true = got["true_actions"]
    out: dict[str, Any] = {"baselines": metrics.baselines(true, got["last_actions"], mean_action), "modes": {}}
    for mode in modes:
        entry: dict[str, metrics.Errors] = {}
        if mode in ACTION_MODES:
            entry["actions"] = metrics.action_errors(got[f"{mode}/actions"], true)
        if mode in VIDEO_MODES:
            entry["video"] = metrics.video_errors(got[f"{mode}/video"], got["true_video"], got[f"{mode}/latents"],
                                                  got["true_latents"])
        out["modes"][mode] = entry
    if "true_video" in got:
        condition = np.repeat(got["true_video"][:, :1], got["true_video"].shape[1], axis=1)
        out["video_baselines"] = {"vae_reconstruction": metrics.video_errors(got["recon"], got["true_video"]),
                                  "copy_condition_frame": metrics.video_errors(condition, got["true_video"])}
    return out


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in SAMPLE_MODES]
    if bad or not modes:
        raise CheckpointError(f"--modes {text!r}: expected a comma-separated list of {', '.join(SAMPLE_MODES)}")
    return modes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint_step_N folder, a run folder or an export")
    p.add_argument("--which", choices=WHICH, default="latest",
                   help="with a run folder: its newest verified checkpoint (latest, default) or the one with the "
                        "highest closed-loop success (best: the run's `best` file)")
    p.add_argument("--config", default=None, help="a recipe YAML replacing the checkpoint's config")
    p.add_argument("--dataset", default=None, help="evaluate every episode of this folder instead of the held-out ones")
    p.add_argument("--episodes", type=int, default=None, help="only the first N episodes")
    p.add_argument("--modes", default=",".join(SAMPLE_MODES), help="comma-separated sampling modes")
    p.add_argument("--seed", type=int, default=0, help="seeds every sample's noise (same seed, same report)")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default model.inference.num_inference_timesteps)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--media", type=int, default=2, help="samples with an mp4 and an action plot")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--weights", choices=WEIGHT_SETS, default=None,
                   help="ema or raw; default: the EMA weights when the checkpoint has them (training.ema), else raw")
    p.add_argument("--report_to", default="none", choices=["none", "tensorboard", "wandb", "all"],
                   help="also log the report's scalars and figures there (utils/metrics.py Metrics)")
    p.add_argument("--out", required=True, help="the report folder (its report files are replaced)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    return p.parse_intermixed_args(argv)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from inference.report import write_report

    modes = parse_modes(args.modes)
    loaded = load_checkpoint(args.checkpoint, args.config, args.overrides, args.device, args.weights, args.which)
    policy = Policy(loaded)
    dataset = eval_dataset(loaded.cfg, loaded.stats, args.dataset)
    windows = dataset.val_windows()
    if args.episodes is not None:
        windows = [w for w in windows if w[0] < args.episodes]
    if not windows:
        raise CheckpointError(f"no evaluation window: the episodes are shorter than {dataset.spec.span + 1} frames")
    torch.manual_seed(args.seed)
    got = run(policy, dataset, windows, modes, args.seed, args.batch_size, args.steps)
    mean_action = loaded.stats.stats[loaded.stats.action_key]["mean"]
    report = {"checkpoint": os.path.abspath(loaded.checkpoint), "weights": loaded.weights,
              "config_hash": loaded.config_hash,
              "seed": args.seed, "num_samples": len(windows), "num_episodes": len({i for i, _ in windows}),
              "num_inference_timesteps": args.steps or loaded.model.settings.inference.num_inference_timesteps,
              "dataset": args.dataset or "held-out episodes of the recipe's dataset",
              **figures(got, modes, mean_action)}
    write_report(report, got, modes, args.out, args.media, loaded, args.report_to)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from data.errors import DataError
    from models.serialization import ModelLoadError
    from utils.config import ConfigError
    try:
        report = evaluate(args)
    except (CheckpointError, ConfigError, DataError, ModelLoadError) as e:
        sys.exit(f"evaluate failed: {e}")
    print(f"wrote {os.path.join(args.out, 'report.md')} ({report['num_samples']} samples)")


if __name__ == "__main__":
    main()
