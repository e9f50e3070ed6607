"""The names of the files in a checkpoint_step_N folder that more than one module reads or writes.

`engine/` is the engine's part (train/engine.py): what DeepSpeed's `save_checkpoint` writes, or DDP's
two files, plus the ZeRO layout that lets the state move to another world size (checkpoint/zero.py)
and, with training.ema.enabled, the EMA of the weights (written by the engines: train/engine.py,
train/deepspeed_engine.py). Changing a name here makes every
checkpoint written before unreadable: the manifest's format version (checkpoint/manifest.py) must change too.
"""
import re

ENGINE_DIR = "engine"
CONFIG_YAML = "config.yaml"
"""The run's config as trained (resume compares against it, export rebuilds the model from it)."""

DEEPSPEED_MODEL_FILE = "mp_rank_00_model_states.pt"
"""DeepSpeed's module weights and step counters (rank 0 writes it)."""
DEEPSPEED_OPTIMIZER_FILE = "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
"""Rank r's ZeRO-1/2 shard: its fp32 master slice and optimizer state. DeepSpeed prefixes the name
under bf16 (`bf16_zero_pp_rank_...`): match it at the end of a name."""
DDP_MODEL_FILE = "model.pt"
DDP_OPTIMIZER_FILE = "optimizer.pt"
LAYOUT_FILE = "zero_layout.json"
"""Every tensor's place in the optimizer's groups (checkpoint/zero.py), written beside either engine's files."""
# The EMA of the weights: under ZeRO-1/2 rank r's slice, laid out like its fp32
# master partition ({"updates": n, "partitions": [one flat tensor per group]}); under DDP and
# stage 0 one whole file ({"updates": n, "weights": {name: tensor}}).
EMA_SHARD_FILE = "ema_rank_{rank}.pt"
EMA_FILE = "ema.pt"


def rank_pattern(name: str) -> str:
    """The regex of a file name above that has a {rank} field; its one group is the rank."""
    return re.escape(name).replace(re.escape("{rank}"), r"(\d+)")
