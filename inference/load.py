"""Load a trained world model for inference: weights, frozen encoders, normalisation statistics and
the recipe's config, from any of the folders training and export write.

`--checkpoint PATH` may be
- a `checkpoint_step_N/` folder (its `config.yaml` and `norm_stats.json` travel with it);
- a run folder: its newest complete checkpoint that passes verification (as
  `resume.checkpoint_path=auto` picks it; damaged ones are skipped with a warning), or with
  `--which best` the one its `best` file names (the highest closed-loop success, checkpoint/evaluations.py);
- an exported folder (`python -m checkpoint.export`): `config.json` holds the model and `common`
  sections, `norm_stats.json` the statistics; the other sections take the schema's defaults.
`--config CFG` replaces the config that came with the checkpoint (the architecture always comes
from the checkpoint); the statistics always come from the checkpoint.
"""
import glob
import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from checkpoint.checkpointer import PREFIX, resolve_which
from checkpoint.export import CONFIG_YAML, NORM_STATS, model_spec_from_config
from checkpoint.finetune import WEIGHT_SETS, FinetuneError, inference_weights
from checkpoint.manifest import CheckpointCorrupt
from models.serialization import CONFIG_NAME, ModelLoadError, read_config

if TYPE_CHECKING:
    from data.normalize import NormStats
    from models.encoders import FrozenEncoders
    from models.world_model import WorldModel

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A --checkpoint that cannot be evaluated or served: the message names the path and what was expected."""


@dataclass
class Loaded:
    model: "WorldModel"
    """The WorldModel in eval mode on `device`."""
    encoders: "FrozenEncoders"
    """FrozenEncoders on `device`."""
    stats: "NormStats"
    """NormStats the model was trained with."""
    cfg: DictConfig
    """The recipe config (read-only)."""
    checkpoint: str
    """The resolved folder the weights came from."""
    device: torch.device
    weights: str = "raw"
    """The weight set loaded: "ema" (the moving average, training.ema) or "raw"."""

    @property
    def config_hash(self) -> str:
        return config_hash(self.cfg)


def config_hash(cfg: DictConfig) -> str:
    """First 16 hex digits of the sha256 of the resolved config as sorted YAML."""
    return hashlib.sha256(OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True).encode()).hexdigest()[:16]


def resolve_checkpoint(path: str, which: str = "latest") -> str:
    """A run folder -> its newest complete checkpoint that passes verification, by the rule
    `resume.checkpoint_path=auto` follows, or with `which` "best" the one its `best` file names
    (checkpoint.checkpointer.resolve_which); a checkpoint folder -> itself, if complete and whole;
    an exported folder -> itself."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--checkpoint '{path}' is not a folder; expected a {PREFIX}N folder, a run "
                              "folder or an exported folder")
    is_checkpoint = os.path.basename(os.path.normpath(path)).startswith(PREFIX)
    if not is_checkpoint and os.path.isfile(os.path.join(path, CONFIG_NAME)):
        if which != "latest":
            raise CheckpointError(f"--which {which} picks a checkpoint of a run folder, and --checkpoint '{path}' "
                                  "is an exported folder: leave out --which")
        return path
    if not is_checkpoint and not glob.glob(os.path.join(path, PREFIX + "*")):
        raise CheckpointError(f"--checkpoint '{path}' is neither a {PREFIX}N folder, a run folder (holding "
                              f"{PREFIX}N folders) nor an exported folder (with {CONFIG_NAME})")
    try:
        found = resolve_which(path, which, key="--checkpoint")  # damaged ones skipped loudly
    except (FileNotFoundError, CheckpointCorrupt) as e:
        raise CheckpointError(str(e)) from None
    if not os.path.isfile(os.path.join(found, CONFIG_YAML)):
        raise CheckpointError(f"'{found}' has no {CONFIG_YAML}; expected a folder written by train/train.py")
    return found


def _exported_config(folder: str, overrides: Iterable[str]) -> tuple[DictConfig, dict[str, Any]]:
    """An exported folder's config.json `model` and `common` sections as a full recipe config."""
    import tempfile

    from recipe.config import load_config

    spec = read_config(folder)
    if "common" not in spec:
        raise CheckpointError(f"'{folder}/{CONFIG_NAME}' has no 'common' section (an export older than the "
                              "inference commands); pass --config with the recipe it was trained with")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(OmegaConf.to_yaml({"model": spec["model"], "common": spec["common"]}))
    try:
        return load_config(f.name, overrides, saved=True), spec
    finally:
        os.remove(f.name)


def load_recipe(folder: str, config: str | None = None,
                overrides: Iterable[str] = ()) -> tuple[DictConfig, dict[str, Any]]:
    """(the recipe config, the architecture spec) for a resolved checkpoint folder."""
    from recipe.config import load_config
    from recipe.generated import ensure_generated_inputs

    if os.path.isfile(os.path.join(folder, CONFIG_NAME)):
        cfg, spec = _exported_config(folder, overrides)
    else:
        cfg = load_config(os.path.join(folder, CONFIG_YAML), overrides, saved=True)
        ensure_generated_inputs(cfg, dataset=False)  # the parts' config files give the architecture
        spec = model_spec_from_config(cfg)
    if config is not None:
        cfg = load_config(config, overrides)
    ensure_generated_inputs(cfg, dataset=False)  # the frozen encoders inference builds from it
    return cfg, spec


def load_stats(folder: str) -> "NormStats":
    from data.normalize import NormStats

    path = os.path.join(folder, NORM_STATS)
    if not os.path.isfile(path):
        raise CheckpointError(f"'{folder}' has no {NORM_STATS}: without the training statistics actions cannot be "
                              "given in robot units")
    return NormStats.load(path)


def build_model(spec: dict[str, Any], weights: dict[str, torch.Tensor], folder: str) -> "WorldModel":
    from accelerate import init_empty_weights

    from models.world_model import WorldModel

    with init_empty_weights():  # the architecture only: every tensor comes from the checkpoint
        model = WorldModel(spec)
    try:
        # clone: DeepSpeed's module tensors are views of one flat buffer
        model.load_state_dict({k: v.clone() for k, v in weights.items()}, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"'{folder}': the weights do not fit the model its config describes: {e}") from None
    return model


def load_checkpoint(path: str, config: str | None = None, overrides: Iterable[str] = (),
                    device: str | torch.device = "cpu", weights: str | None = None, which: str = "latest") -> Loaded:
    """Everything inference needs from `path` (see the module docstring) -> Loaded. `weights`: "ema",
    "raw" or None (the EMA weights when the checkpoint has them, else the raw ones; logged). `which`:
    "latest" or "best", the checkpoint a run folder gives."""
    from models.build import ALL_FROZEN_PARTS, build_encoders
    from models.sizes import get_size

    folder = resolve_checkpoint(path, which)
    cfg, spec = load_recipe(folder, config, overrides)
    stats = load_stats(folder)
    try:
        state, which, note = inference_weights(folder, weights, key="--checkpoint")
    except (FinetuneError, ModelLoadError) as e:
        raise CheckpointError(str(e)) from None
    device = torch.device(device)
    model = build_model(spec, state, folder).to(device).eval()
    # raw robot observations: every frozen part, even when the recipe trained from a latent cache
    encoders = build_encoders(cfg, get_size(cfg.model.size), ALL_FROZEN_PARTS).to(device)
    log.info("loaded %s (%s, config %s) on %s; %s", folder, cfg.model.size, config_hash(cfg), device, note)
    return Loaded(model, encoders, stats, cfg, folder, device, which)
