"""Writing a model folder (what `WorldModel.from_pretrained` and `finetune.checkpoint_path` read):
the helpers shared by `python -m checkpoint.export`, `python -m models.convert_motus` and inference.

A model folder holds config.json (`model_spec_from_config`: the model's spec plus the `common`
section), the safetensors weights (models/serialization.py) and, from an export, `NORM_STATS`.
"""
import glob
import os
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from models.serialization import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME

NORM_STATS = "norm_stats.json"
"""The normalisation statistics the model was trained with (data/normalize.py writes them)."""
UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
         "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


class ExportError(RuntimeError):
    """An export that cannot be written; the message names the path and what was expected."""


def parse_size(text: str) -> int:
    """'5GB' (10^9 bytes), '500MiB' (2^20), '1024' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or (unit and unit not in UNITS):
        raise ExportError(f"--max-shard-size '{text}': expected a size such as 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * UNITS[unit or "B"])
    if size <= 0:
        raise ExportError(f"--max-shard-size '{text}': expected a positive size")
    return size


def model_spec_from_config(cfg: DictConfig) -> dict[str, Any]:
    """The spec `build_world_model` builds the WorldModel from, rebuilt from the run's config, plus
    the `common` section (action and state dims, frames, image size) for inference code."""
    from models.build import spec_from_config

    spec = spec_from_config(cfg)
    spec["common"] = OmegaConf.to_container(cfg.common, resolve=True)
    return spec


def check_out_dir(out_dir: str, overwrite: bool) -> None:
    """Make `out_dir` ready for a model folder: empty, or (`overwrite`) cleared of a folder written before."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        if not overwrite:
            raise ExportError(f"'{out_dir}' is not empty; pass --overwrite to replace an export there, "
                              "or choose an empty folder")
        # only the files an export writes: a stale shard must not survive a smaller re-export
        ours = [CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME, NORM_STATS]
        for path in [os.path.join(out_dir, f) for f in ours] + glob.glob(
                os.path.join(out_dir, "model-*-of-*.safetensors")):
            if os.path.isfile(path):
                os.remove(path)
    os.makedirs(out_dir, exist_ok=True)
