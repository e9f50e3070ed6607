"""The names of a run folder: its `checkpoint_step_N/` folders and the COMPLETE marker that makes one
loadable. Here, below checkpoint/checkpointer.py and checkpoint/evaluations.py, so that both read them."""
import glob
import os
import re

PREFIX = "checkpoint_step_"
MARKER = "COMPLETE"
WHICH = ("latest", "best")
"""What `--which` picks from a run folder: its newest verified checkpoint (the one `latest` names, unless
damaged), or the one its `best` file names (checkpoint/evaluations.py)."""


def step_of(path: str) -> int | None:
    """N of a `checkpoint_step_N` folder; None for any other name."""
    m = re.fullmatch(PREFIX + r"(\d+)", os.path.basename(path.rstrip("/")))
    return int(m.group(1)) if m else None


def is_complete(path: str) -> bool:
    return step_of(path) is not None and os.path.isfile(os.path.join(path, MARKER))


def saved_steps(run_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of each complete checkpoint of a run, oldest first."""
    found = [(step_of(p), p) for p in glob.glob(os.path.join(run_dir, PREFIX + "*")) if is_complete(p)]
    return sorted((step, p) for step, p in found if step is not None)  # complete: every one has a step


def complete_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first."""
    return [p for _, p in saved_steps(run_dir)]
