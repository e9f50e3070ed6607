"""Where a run lives: {system.checkpoint_dir}/{config stem}/{run_name}/."""
import glob
import os
import time
from typing import TypeVar

import torch.distributed as tdist
from omegaconf import DictConfig

from checkpoint.checkpointer import complete_checkpoints, resolve_resume_path

T = TypeVar("T")


def default_run_name(cfg: DictConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{cfg.model.size}-{cfg.training.optimizer}-lr{cfg.training.learning_rate:g}-{stamp}"


def _agree(value: T) -> T:
    """Rank 0's value on every rank (the timestamp of a default run name must be one)."""
    if not tdist.is_initialized():
        return value
    box = [value]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def newest_run_with_checkpoint(config_dir: str) -> str | None:
    newest = [found[-1] for found in map(complete_checkpoints, glob.glob(os.path.join(config_dir, "*"))) if found]
    return os.path.dirname(max(newest, key=os.path.getmtime)) if newest else None


def choose_run_dir(cfg: DictConfig, stem: str) -> tuple[str, str | None]:
    """Return (run_dir, checkpoint to resume from or None).

    resume.checkpoint_path = a folder: continue that run in its own folder (verified first).
    resume.checkpoint_path = auto: the named run's newest checkpoint that passes verification, or
    without a run name the newest run of this config; start fresh if there is none. A run whose
    checkpoints all fail verification is an error, never a fresh start. Collective (verification).
    """
    config_dir = os.path.join(cfg.system.checkpoint_dir, stem)
    name = cfg.logging.run_name
    path = cfg.resume.checkpoint_path
    if path not in (None, "auto"):
        ckpt = resolve_resume_path(path, None)
        return os.path.dirname(os.path.abspath(ckpt)), ckpt
    if path == "auto":
        run_dir = os.path.join(config_dir, name) if name else newest_run_with_checkpoint(config_dir)
        if run_dir is not None:
            newest = resolve_resume_path("auto", run_dir)  # None: nothing saved yet
            if newest is not None:
                return run_dir, newest
    run_dir = os.path.join(config_dir, name or _agree(default_run_name(cfg)))
    if complete_checkpoints(run_dir):
        raise FileExistsError(
            f"run directory '{run_dir}' already holds checkpoints; set resume.checkpoint_path=auto to "
            "continue it, or pick another --run_name (nothing was overwritten)")
    return run_dir, None
