"""Write an evaluation: report.json, report.md with its PNG plots, and per-sample media."""
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from omegaconf import DictConfig

    from inference.load import Loaded

MEDIA_FPS = 4  # a window holds a handful of frames: slow enough to follow
MEDIA_SCALE = 4  # nearest-neighbour upscaling of the tiny frames, so a player shows them at a visible size


def _save(fig: "Figure", path: str) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(report: dict[str, Any], out: str) -> dict[str, str]:
    """The report's curves as PNG files in `out`; returns {name: file name}."""
    from models.report import curve_figure

    action_modes = {m: e["actions"] for m, e in report["modes"].items() if "actions" in e}
    video_modes = {m: e["video"] for m, e in report["modes"].items() if "video" in e}
    made: dict[str, str] = {}
    if action_modes:
        rows = {**action_modes, **{f"baseline: {k}": v for k, v in report["baselines"].items()}}
        for key, xlabel in (("mse_per_step", "step of the action chunk"), ("mse_per_dim", "action dimension")):
            fig = curve_figure({k: v[key] for k, v in rows.items()}, xlabel, "MSE (robot units²)",
                               f"action {key.replace('_', ' ')}", log_y=True)
            made[key] = f"action_{key}.png"
            _save(fig, os.path.join(out, made[key]))
    if video_modes:
        rows = {**video_modes, **{f"reference: {k}": v for k, v in report["video_baselines"].items()}}
        fig = curve_figure({k: v["psnr_per_frame"] for k, v in rows.items()}, "predicted frame (after the condition)",
                           "PSNR (dB)", "decoded frames vs true")
        made["psnr_per_frame"] = "video_psnr_per_frame.png"
        _save(fig, os.path.join(out, made["psnr_per_frame"]))
    return made


def media(got: dict[str, np.ndarray], modes: Sequence[str], out: str, count: int) -> list[str]:
    """For the first `count` samples: true | predicted mp4 per video mode, true vs predicted action PNG per
    action mode. Returns the written file names."""
    import torch

    from utils.video_file import VideoEncoder
    from models.flow import ACTION_MODES, VIDEO_MODES
    from models.report import action_figure, side_by_side

    os.makedirs(os.path.join(out, "samples"), exist_ok=True)
    written = []
    for k in range(min(count, len(got["true_actions"]))):
        for mode in modes:
            if mode in VIDEO_MODES:
                frames = side_by_side(torch.from_numpy(got["true_video"][k]), torch.from_numpy(got[f"{mode}/video"][k]))
                frames = frames.repeat(MEDIA_SCALE, axis=1).repeat(MEDIA_SCALE, axis=2)
                name = os.path.join("samples", f"sample{k}_{mode}.mp4")
                enc = VideoEncoder(os.path.join(out, name), MEDIA_FPS, frames.shape[2], frames.shape[1],
                                   codec="libx264", crf=18, gop=12)
                for frame in frames:
                    enc.write(frame)
                enc.close()
                written.append(name)
            if mode in ACTION_MODES:
                fig = action_figure(torch.from_numpy(got["true_actions"][k:k + 1]),
                                    torch.from_numpy(got[f"{mode}/actions"][k:k + 1]))
                name = os.path.join("samples", f"sample{k}_{mode}_actions.png")
                _save(fig, os.path.join(out, name))
                written.append(name)
    return written


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def markdown(report: dict[str, Any], made: dict[str, str], written: list[str]) -> str:
    lines = [f"# Evaluation of `{report['checkpoint']}`", "",
             f"config hash `{report['config_hash']}`, seed {report['seed']}, {report['num_samples']} samples from "
             f"{report['num_episodes']} episodes ({report['dataset']}), "
             f"{report['num_inference_timesteps']} Euler steps. Actions in robot units.", ""]
    rows = {m: e["actions"] for m, e in report["modes"].items() if "actions" in e}
    if rows:
        rows.update({f"baseline: {k}": v for k, v in report["baselines"].items()})
        dims = len(next(iter(rows.values()))["mse_per_dim"])
        lines += ["## Actions", "", "| | MSE | MAE | " + " | ".join(f"MSE dim {d}" for d in range(dims)) + " |",
                  "|---" * (dims + 3) + "|"]
        lines += [f"| {k} | {_fmt(v['mse'])} | {_fmt(v['mae'])} | " + " | ".join(map(_fmt, v["mse_per_dim"])) + " |"
                  for k, v in rows.items()]
        lines += ["", "Per step of the chunk (MSE):", ""]
        steps = len(next(iter(rows.values()))["mse_per_step"])
        lines += ["| | " + " | ".join(str(s) for s in range(steps)) + " |", "|---" * (steps + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(map(_fmt, v["mse_per_step"])) + " |" for k, v in rows.items()]
        lines += ["", *(f"![{k}]({made[k]})" for k in ("mse_per_step", "mse_per_dim") if k in made), ""]
    rows = {m: e["video"] for m, e in report["modes"].items() if "video" in e}
    if rows:
        rows.update({f"reference: {k}": v for k, v in report["video_baselines"].items()})
        lines += ["## Video", "", "| | PSNR (dB) | latent MSE | PSNR per frame |", "|---|---|---|---|"]
        lines += [f"| {k} | {_fmt(v['psnr'])} | {_fmt(v['latent_mse']) if 'latent_mse' in v else ''} | "
                  + ", ".join(map(_fmt, v["psnr_per_frame"])) + " |" for k, v in rows.items()]
        lines += ["", f"![psnr]({made['psnr_per_frame']})", ""]
    if written:
        lines += ["## Samples", "", *(f"- [{w}]({w})" for w in written), ""]
    return "\n".join(lines)


def scalars(report: dict[str, Any]) -> dict[str, float]:
    """The report's headline numbers as flat `eval/...` scalars (for TensorBoard and wandb)."""
    flat: dict[str, float] = {}
    for mode, entry in report["modes"].items():
        for kind, values in entry.items():
            flat.update({f"eval/{mode}/{kind}_{k}": v for k, v in values.items() if isinstance(v, float)})
    for name, values in {**report["baselines"], **report.get("video_baselines", {})}.items():
        flat.update({f"eval/baseline_{name}/{k}": v for k, v in values.items() if isinstance(v, float)})
    return flat


def log_to(report_to: str, cfg: "DictConfig", out: str, report: dict[str, Any], made: dict[str, str]) -> None:
    from PIL import Image

    from utils.metrics import Metrics

    metrics = Metrics(cfg, out, True, 0, report_to)
    metrics.log({"step": 0, **scalars(report)})
    images = {f"eval/{k}": np.asarray(Image.open(os.path.join(out, f)).convert("RGB")).transpose(2, 0, 1) / 255.0
              for k, f in made.items()}
    metrics.add_figures(0, images, {})
    metrics.close()


def write_report(report: dict[str, Any], got: dict[str, np.ndarray], modes: Sequence[str], out: str, count: int,
                 loaded: "Loaded", report_to: str = "none") -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, sort_keys=True)
    made = plots(report, out)
    written = media(got, modes, out, count)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report, made, written))
    if report_to != "none":
        log_to(report_to, loaded.cfg, out, report, made)
