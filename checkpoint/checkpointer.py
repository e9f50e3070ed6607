"""Crash-safe training checkpoints: write under a temporary name, mark complete, rename.

Layout of `{run_dir}/checkpoint_step_{N}/`:
  engine/            model + optimizer state (DeepSpeed shards, or DDP's full state)
  trainer_state.json step, samples seen, lr schedule, data stream position, world size
  rng/rank_{r}.pt    python, numpy and torch RNG states of every rank
  config.yaml        the resolved config
  norm_stats.json    the normalisation statistics
  COMPLETE           written last, before the rename
`{run_dir}/latest` names the newest complete checkpoint.
"""
import glob
import json
import os
import random
import re
import shutil

import numpy as np
import torch
from omegaconf import OmegaConf

from utils import dist

PREFIX = "checkpoint_step_"
MARKER = "COMPLETE"


def _fsync_write(path, text):
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _step_of(path):
    m = re.fullmatch(PREFIX + r"(\d+)", os.path.basename(path.rstrip("/")))
    return int(m.group(1)) if m else None


def is_complete(path):
    return _step_of(path) is not None and os.path.isfile(os.path.join(path, MARKER))


def complete_checkpoints(run_dir):
    """Complete checkpoints of a run, oldest first."""
    found = [p for p in glob.glob(os.path.join(run_dir, PREFIX + "*")) if is_complete(p)]
    return sorted(found, key=_step_of)


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def resolve_resume_path(path, run_dir):
    """`auto` -> newest complete checkpoint of this run (None if there is none); a run folder ->
    its newest complete checkpoint; a checkpoint folder -> itself, if complete."""
    if path is None:
        return None
    if path == "auto":
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"resume.checkpoint_path '{path}' does not exist")
    if _step_of(path) is None:
        found = complete_checkpoints(path)
        if not found:
            raise FileNotFoundError(f"resume.checkpoint_path '{path}' holds no complete {PREFIX}N folder")
        return found[-1]
    if not is_complete(path):
        raise FileNotFoundError(f"resume.checkpoint_path '{path}' is not a complete checkpoint "
                                f"(no {MARKER} marker: its save was interrupted); pick an older one or use auto")
    return path


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly."""

    def __init__(self, run_dir, cfg, total_limit):
        self.run_dir = run_dir
        self.cfg = cfg
        self.total_limit = total_limit

    def remove_interrupted_saves(self):
        """Temporary folders of saves that were killed: never loadable, safe to delete (rank 0)."""
        if dist.is_main():
            for tmp in glob.glob(os.path.join(self.run_dir, f".tmp_{PREFIX}*")) + \
                    glob.glob(os.path.join(self.run_dir, f".trash_{PREFIX}*")):
                shutil.rmtree(tmp, ignore_errors=True)

    def save(self, step, engine, trainer_state, norm_stats):
        """Collective: call on every rank."""
        final = os.path.join(self.run_dir, f"{PREFIX}{step}")
        if is_complete(final):  # a rewound run reached a step saved before: keep what is on disk
            if dist.is_main():
                print(f"checkpoint: {final} already exists and is kept as it is", flush=True)
            return final
        tmp = os.path.join(self.run_dir, f".tmp_{PREFIX}{step}")
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        dist.barrier()
        engine.save(tmp)
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{dist.rank()}.pt"))
        dist.barrier()  # every rank has written its shard
        if dist.is_main():
            _fsync_write(os.path.join(tmp, "trainer_state.json"), json.dumps(trainer_state, indent=1))
            _fsync_write(os.path.join(tmp, "config.yaml"), OmegaConf.to_yaml(self.cfg))
            if norm_stats is not None:
                norm_stats.save(os.path.join(tmp, "norm_stats.json"))
            _fsync_write(os.path.join(tmp, MARKER), f"{step}\n")
            os.replace(tmp, final)
            _fsync_write(os.path.join(self.run_dir, "latest.tmp"), os.path.basename(final) + "\n")
            os.replace(os.path.join(self.run_dir, "latest.tmp"), os.path.join(self.run_dir, "latest"))
            self._apply_retention(keep=final)
        dist.barrier()
        return final

    def _apply_retention(self, keep):
        if not self.total_limit:
            return
        found = complete_checkpoints(self.run_dir)
        for old in found[:-self.total_limit]:
            if old == keep:
                continue
            # rename first: a crash during the delete must not leave a half-deleted "complete" folder
            trash = os.path.join(self.run_dir, f".trash_{os.path.basename(old)}")
            os.replace(old, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def load(self, path, load_engine):
        """Restore engine state (via `load_engine(path)`), this rank's RNG; return the trainer state."""
        load_engine(path)
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        rng_file = os.path.join(path, "rng", f"rank_{dist.rank()}.pt")
        if state.get("world_size") == dist.world_size() and os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, weights_only=False))
        return state
