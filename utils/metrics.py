"""Training metrics on rank 0: metrics.jsonl, TensorBoard, wandb, and progress on the console.

Everything logged goes to every enabled sink: scalars, pictures (validation frame grids, action
plots) and videos. Progress is tqdm's bar in a terminal and a plain log line per logging step
otherwise (SLURM, nohup, CI), where a bar's carriage returns would make one endless line.
"""
import contextlib
import datetime
import io
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from omegaconf import DictConfig

from utils.wandb_setup import init_wandb

log = logging.getLogger(__name__)

REPORT_TO = ("tensorboard", "wandb", "all", "none")
WANDB_MODES = ("online", "offline", "disabled")
PROGRESS = ("auto", "bar", "lines")
STRIP_FRAMES = 16  # at most this many frames in the TensorBoard picture of a video


def rewind_metrics(path: str, step: int) -> None:
    """On resume at `step`, keep records up to it; move later ones aside (never delete them)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [(json.loads(line)["step"], line) for line in f if line.strip()]
    keep = [line for s, line in lines if s <= step]
    later = [line for s, line in lines if s > step]
    if not later:
        return
    aside = f"{os.path.splitext(path)[0]}.rewound_from_step_{step}.jsonl"
    with open(aside, "a") as f:
        f.writelines(later)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


class Metrics:
    """Writes one JSON object per logged step and mirrors it, and every picture, to TensorBoard and wandb."""

    def __init__(self, cfg: DictConfig, run_dir: str, enabled: bool, start_step: int, report_to: str) -> None:
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb: Any = None  # a SummaryWriter
        self.wandb: Any = None  # a wandb run
        self.progress_display: Progress | None = None
        self._warned_strip = False
        self.lines_lost = 0  # metrics.jsonl records not written in this process (a full disk)
        self.step = start_step  # the last training step logged: wandb's current step
        self._failing: dict[str, int] = {}  # sink -> writes failed since it last worked
        if not enabled:
            return
        if report_to in ("wandb", "all"):  # first: it may stop for missing credentials
            self.wandb = init_wandb(cfg, run_dir)
            # an evaluation is logged when it ends, at its checkpoint's earlier step, and wandb's own step
            # only grows: the eval/* charts take eval/step as their x-axis instead
            self.wandb.define_metric("eval/step")
            self.wandb.define_metric("eval/*", step_metric="eval/step")
        rewind_metrics(self.path, start_step)
        if report_to in ("tensorboard", "all"):
            from torch.utils.tensorboard import SummaryWriter
            # One event stream per run folder; on resume at step S, events after S that the run
            # wrote before it stopped are purged, so each step appears once.
            self.tb = SummaryWriter(os.path.join(run_dir, cfg.logging.tensorboard_log_dir),
                                    purge_step=start_step + 1 if start_step else None)
        # Last, so that its clock (the ETA) starts when training does.
        self.progress_display = Progress(cfg.training.max_steps, start_step, cfg.logging.progress)

    def log(self, record: dict[str, Any]) -> None:
        """`record` holds step and scalars; `lr` is a dict of group name -> lr."""
        if not self.enabled:
            return
        if self.lines_lost:
            record = {**record, "metrics_lines_lost": self.lines_lost}
        if not self._try(self.path, append_line, self.path, json.dumps(record) + "\n"):
            self.lines_lost += 1
        step = self.step = record["step"]
        flat = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        flat.update({f"lr/{name}": lr for name, lr in record.get("lr", {}).items()})
        if self.tb:
            self._try("TensorBoard", self._tb_scalars, step, flat)
        if self.wandb:
            self._try("wandb", self.wandb.log, flat, step=step)

    def _tb_scalars(self, step: int, flat: dict[str, float]) -> None:
        for k, v in flat.items():
            self.tb.add_scalar(k, v, step)

    def _try(self, sink: str, write: Callable[..., object], *args: Any, **kwargs: Any) -> bool:
        """write(*args, **kwargs), True if it worked. An OSError (a full disk, an I/O error) is warned about once and
        swallowed: only rank 0 writes metrics, and a rank 0 that died here would leave the others
        waiting in their next collective until the timeout, losing the run over a log line."""
        try:
            write(*args, **kwargs)
        except OSError as e:
            self._failing[sink] = self._failing.get(sink, 0) + 1
            if self._failing[sink] == 1:
                log.warning("!!! cannot write %s (%s). Training continues and checkpoints are unaffected "
                            "(a save that fails stops the run on every rank); every record retries the "
                            "write, and metrics.jsonl records not written are counted in its "
                            "`metrics_lines_lost`. Free space on that disk.", sink, e)
            return False
        failed = self._failing.pop(sink, 0)
        if failed:
            log.warning("%s is written again, after %d failed writes", sink, failed)
        return True

    def progress(self, step: int, record: dict[str, Any]) -> None:
        if self.enabled and self.progress_display is not None:
            self.progress_display.update(step, record)

    def add_figures(self, step: int, images: dict[str, Any] | None = None,
                    figures: dict[str, Any] | None = None) -> None:
        """Pictures: `images` name -> CHW tensor or array in [0, 1]; `figures` name -> matplotlib figure
        (rendered once, then closed)."""
        if not self.enabled:
            return
        pictures = {name: chw_to_hwc_uint8(img) for name, img in (images or {}).items()}
        pictures.update({name: figure_to_array(fig) for name, fig in (figures or {}).items()})
        if self.tb:
            self._try("TensorBoard", self._tb_images, step, pictures)
        if self.wandb:  # wandb.Image writes a file too: built inside the guarded call
            import wandb
            self._try("wandb", lambda: self.wandb.log({name: wandb.Image(pic) for name, pic in pictures.items()},
                                                      step=step))

    def _tb_images(self, step: int, pictures: dict[str, np.ndarray]) -> None:
        for name, pic in pictures.items():
            self.tb.add_image(name, pic, step, dataformats="HWC")

    def add_video(self, step: int, name: str, frames: Any, fps: float) -> None:
        """A video: `frames` uint8 [T, H, W, 3] or [T, 3, H, W] (tensor or array). wandb gets an
        H.264 mp4; TensorBoard a playable clip if moviepy is installed, else a strip of frames."""
        if not self.enabled:
            return
        frames = video_to_thwc(frames, name)
        if self.tb:
            self._try("TensorBoard", self._tb_video, step, name, frames, fps)
        if self.wandb:
            self._try("wandb", lambda: self.wandb.log({name: wandb_video(frames, fps)}, step=step))

    def log_evaluation(self, step: int, figures: dict[str, float | str], video: str | None = None) -> None:
        """A closed-loop evaluation of the checkpoint saved at `step`, logged at that step although training
        is past it when the evaluation ends: `figures` eval/* name -> number, or eval/error -> its message
        (TensorBoard text); `video` one episode's mp4 file, logged as eval/video."""
        if not self.enabled:
            return
        if not self._try(self.path, append_line, self.path, json.dumps({"step": step, **figures}) + "\n"):
            self.lines_lost += 1
        clip = None
        if video is not None:
            from utils.video_file import read_mp4  # PyAV: only when a video is logged

            try:
                clip = read_mp4(video)
            except (OSError, ValueError) as e:  # the figures are logged all the same
                log.warning("the evaluation video %s of step %d cannot be read (%s); not logged", video, step, e)
        if self.tb:
            self._try("TensorBoard", self._tb_evaluation, step, figures, clip)
        if self.wandb:
            self._try("wandb", self._wandb_evaluation, step, figures, clip)

    def _tb_evaluation(self, step: int, figures: dict[str, float | str],
                       clip: tuple[np.ndarray, float] | None) -> None:
        for name, value in figures.items():
            if isinstance(value, str):
                self.tb.add_text(name, value, step)
            else:
                self.tb.add_scalar(name, value, step)
        if clip is not None:
            self._tb_video(step, "eval/video", *clip)

    def _wandb_evaluation(self, step: int, figures: dict[str, float | str],
                          clip: tuple[np.ndarray, float] | None) -> None:
        row: dict[str, Any] = {**figures, "eval/step": step}
        if clip is not None:
            row["eval/video"] = wandb_video(*clip)
        self.wandb.log(row, step=self.step)  # at wandb's current step: an earlier one would be dropped

    def _tb_video(self, step: int, name: str, frames: np.ndarray, fps: float) -> None:
        try:
            import moviepy.editor  # noqa: F401  (what TensorBoard's add_video needs)
        except ImportError:
            if not self._warned_strip:
                log.warning("moviepy is not installed: TensorBoard shows videos as a strip of up to %d "
                            "frames (pip install 'moviepy<2' for playable clips); wandb gets the mp4",
                            STRIP_FRAMES)
                self._warned_strip = True
            self.tb.add_image(name, frame_strip(frames), step, dataformats="HWC")
            return
        import torch
        self.tb.add_video(name, torch.from_numpy(frames).permute(0, 3, 1, 2)[None], step, fps=fps)

    def close(self) -> None:
        if self.progress_display:
            self.progress_display.close()
        if self.tb:
            self._try("TensorBoard", self.tb.close)
        if self.wandb:
            self._try("wandb", self.wandb.finish)
        if self.lines_lost:
            log.warning("!!! %d records of this run are missing from %s: their writes failed (see the "
                        "warnings above); the checkpoints are unaffected", self.lines_lost, self.path)


def wandb_video(frames: np.ndarray, fps: float) -> Any:
    """uint8 [T, H, W, 3] frames as a wandb.Video: an H.264 mp4, which browsers play."""
    import wandb

    from utils.video_file import encode_mp4  # PyAV: only when a video is logged

    return wandb.Video(io.BytesIO(encode_mp4(frames, fps)), format="mp4")


def append_line(path: str, line: str) -> None:
    """Append `line` whole or not at all: a write cut short by a full disk is cut off again, so the
    next record starts on a line of its own and every line of the file stays valid JSON."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        with open(path, "a") as f:
            f.write(line)
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


def use_bar(mode: str) -> bool:
    """`logging.progress`: bar, lines, or auto = a bar when stderr (where tqdm writes) is a terminal."""
    return mode == "bar" or (mode == "auto" and sys.stderr.isatty())


def quiet_library_bars(mode: str) -> None:
    """Without our bar, also silence the bars transformers, diffusers and huggingface_hub draw while
    loading weights: in a log file each is a line of carriage-return updates."""
    if use_bar(mode):
        return
    import diffusers.utils.logging
    import huggingface_hub.utils
    import transformers.utils.logging

    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()


class Progress:
    """tqdm's bar (see use_bar), else one log line per update: a file under SLURM or nohup, a pipe in CI."""

    def __init__(self, total: int, start_step: int, mode: str) -> None:
        self.total, self.start_step = total, start_step
        self.use_bar = use_bar(mode)
        self.bar: Any = None  # a tqdm bar, made at the first update
        self.started = time.perf_counter()

    def update(self, step: int, record: dict[str, Any]) -> None:
        if not self.use_bar:
            log.info(progress_line(step, self.total, record, self.eta(step)))
            return
        if self.bar is None:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, initial=self.start_step, desc="train", dynamic_ncols=True)
        self.bar.n = step
        lr = next(iter(record.get("lr", {}).values()), 0.0)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{lr:.2e}",
                             samples_s=f"{record['samples_per_sec']:.1f}", refresh=False)
        self.bar.refresh()

    def eta(self, step: int) -> float | None:
        """Seconds left at the mean pace of this process so far (validations and saves included)."""
        done = step - self.start_step
        return (time.perf_counter() - self.started) / done * (self.total - step) if done > 0 else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


LOSS_TERMS = (("loss", "loss"), ("video", "video_loss"), ("action", "action_loss"), ("val_loss", "val_loss"))


def progress_line(step: int, total: int, record: dict[str, Any], eta: float | None) -> str:
    """e.g. `step 120/300 loss 1.2340 video 0.5000 action 0.7000 grad_norm 0.85 lr 4.50e-03
    12.3 samples/s eta 0:02:10`; lr per group (`lr muon=... adamw=...`) when the groups differ."""
    parts = [f"step {step}/{total}"]
    parts += [f"{label} {record[key]:.4f}" for label, key in LOSS_TERMS if key in record]
    if "grad_norm" in record:
        parts.append(f"grad_norm {record['grad_norm']:.3g}")
    lrs = record.get("lr", {})
    if len(set(lrs.values())) == 1:
        parts.append(f"lr {next(iter(lrs.values())):.2e}")
    elif lrs:
        parts.append("lr " + " ".join(f"{name}={lr:.2e}" for name, lr in lrs.items()))
    if "samples_per_sec" in record:
        parts.append(f"{record['samples_per_sec']:.1f} samples/s")
    parts.append("eta " + (str(datetime.timedelta(seconds=round(eta))) if eta is not None else "?"))
    return " ".join(parts)


def _numpy(x: Any) -> np.ndarray:  # a tensor (anything with .detach) or array-like
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def chw_to_hwc_uint8(img: Any) -> np.ndarray:
    """CHW in [0, 1] (tensor or array) -> HWC uint8, the form both TensorBoard and wandb take."""
    arr = np.clip(_numpy(img).astype(np.float32), 0.0, 1.0)
    return np.ascontiguousarray((arr.transpose(1, 2, 0) * 255).round().astype(np.uint8))


def figure_to_array(fig: Any) -> np.ndarray:
    """Render a matplotlib figure to HWC uint8 RGB and close it."""
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return rgb


def video_to_thwc(frames: Any, name: str) -> np.ndarray:
    arr = _numpy(frames)
    if arr.ndim == 4 and arr.shape[1] == 3 and arr.shape[-1] != 3:
        arr = arr.transpose(0, 2, 3, 1)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[-1] != 3 or len(arr) == 0:
        raise ValueError(f"video '{name}': expected uint8 frames [T, H, W, 3] or [T, 3, H, W], "
                         f"got {arr.dtype} {list(arr.shape)}")
    return np.ascontiguousarray(arr)


def frame_strip(frames: np.ndarray) -> np.ndarray:
    """Up to STRIP_FRAMES frames, evenly spaced, side by side: [H, n * W, 3]."""
    keep = np.unique(np.linspace(0, len(frames) - 1, min(len(frames), STRIP_FRAMES)).round().astype(int))
    return np.concatenate(list(frames[keep]), axis=1)
