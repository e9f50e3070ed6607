"""Export a training checkpoint as a model folder: `python -m checkpoint.export <checkpoint_dir> <out_dir>`.

`checkpoint_dir` is a checkpoint_step_N folder, or a run folder: its newest verified checkpoint, or with
`--which best` the one with the highest closed-loop success (the run's `best` file, checkpoint/evaluations.py).

Writes what `WorldModel.from_pretrained(out_dir)` and `finetune.checkpoint_path: out_dir` read:
- `config.json`: the model's architecture spec (as `WorldModel.save_pretrained` writes it,
  rebuilt from the checkpoint's `config.yaml`) plus the `common` section (action and state
  dims, frames, image size) for inference code;
- `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`
  above `--max-shard-size`;
- `norm_stats.json`: the normalisation statistics the model was trained with.
The weights are the module's as saved (fp32, or the bf16 copy of a bf16_mixed run), or with
`--weights ema` the EMA of the trainable weights (a run with `training.ema.enabled`), in the same
dtype; config.json's "weights" says which set the folder holds.
"""
import argparse
import glob
import logging
import os
import shutil
import sys
from typing import Sequence

from omegaconf import OmegaConf

from checkpoint.checkpointer import resolve_which
from checkpoint.files import CONFIG_YAML
from checkpoint.finetune import WEIGHT_SETS, FinetuneError, read_weights
from checkpoint.layout import PREFIX, WHICH, step_of
from checkpoint.manifest import CheckpointCorrupt
from models.folder import NORM_STATS, ExportError, check_out_dir, model_spec_from_config, parse_size
from models.serialization import DEFAULT_SHARD_BYTES, ModelLoadError

log = logging.getLogger(__name__)


def export_checkpoint(checkpoint_dir: str, out_dir: str, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                      overwrite: bool = False, weights: str = "raw") -> str:
    """Write the export of `checkpoint_dir` (a checkpoint_step_N folder) into `out_dir`, its `weights`
    set ("raw" or "ema"); returns out_dir."""
    from accelerate import init_empty_weights

    from models.world_model import WorldModel
    from recipe.generated import ensure_generated_inputs

    config_path = os.path.join(checkpoint_dir, CONFIG_YAML)
    if not os.path.isfile(config_path):
        raise ExportError(f"'{checkpoint_dir}' has no {CONFIG_YAML}: expected a checkpoint_step_N folder "
                          "written by train/train.py")
    state = read_weights(checkpoint_dir, key="checkpoint_dir", weights=weights)
    cfg = OmegaConf.load(config_path)
    ensure_generated_inputs(cfg, dataset=False)  # the parts' config files give the architecture
    spec = {**model_spec_from_config(cfg), "weights": weights}
    with init_empty_weights():  # the architecture only: every tensor comes from the checkpoint
        model = WorldModel(spec)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [f"{k}: checkpoint {tuple(state[k].shape)}, config {tuple(expected[k].shape)}"
             for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise ExportError(f"'{checkpoint_dir}': the weights do not fit the model its {CONFIG_YAML} describes "
                          f"(missing {missing[:5]}, unexpected {unexpected[:5]}, shape {wrong[:5]})")
    # clone: DeepSpeed's module tensors are views of one flat buffer, which safetensors refuses
    model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    check_out_dir(out_dir, overwrite)
    model.save_pretrained(out_dir, max_shard_bytes=max_shard_bytes)
    stats = os.path.join(checkpoint_dir, NORM_STATS)
    if os.path.isfile(stats):
        shutil.copyfile(stats, os.path.join(out_dir, NORM_STATS))
    else:
        log.warning("%s has no %s: the export carries no normalisation statistics", checkpoint_dir, NORM_STATS)
    return out_dir


def source_checkpoint(path: str, which: str | None) -> str:
    """The checkpoint_step_N folder to export: `path` itself when it is one (or holds a config.yaml) and no
    `which` is asked for (read as it is, as before run folders were accepted); else what `which` (default
    latest) picks from the run folder `path` (checkpoint.checkpointer.resolve_which), verified."""
    if which is None and (step_of(path) is not None or os.path.isfile(os.path.join(path, CONFIG_YAML))):
        return path
    if step_of(path) is None and not glob.glob(os.path.join(path, PREFIX + "*")):
        raise ExportError(f"'{path}' has no {CONFIG_YAML}: expected a {PREFIX}N folder written by train/train.py, "
                          "or a run folder holding them")
    try:
        return resolve_which(path, which or "latest", key="checkpoint_dir")
    except (FileNotFoundError, CheckpointCorrupt) as e:
        raise ExportError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="a checkpoint_step_N folder, or a run folder (see --which)")
    parser.add_argument("--which", choices=WHICH, default=None,
                        help="with a run folder: its newest verified checkpoint (latest, default) or the one with "
                             "the highest closed-loop success (best: the run's `best` file)")
    parser.add_argument("out_dir", help="the export folder (must be empty unless --overwrite)")
    parser.add_argument("--max-shard-size", default=f"{DEFAULT_SHARD_BYTES // 2 ** 30}GiB",
                        help="largest safetensors file before sharding, e.g. 5GB, 500MB, 2GiB (default 5GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    parser.add_argument("--weights", choices=WEIGHT_SETS, default="raw",
                        help="raw: the trained weights (default); ema: their moving average (training.ema)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        source = source_checkpoint(args.checkpoint_dir, args.which)
        out = export_checkpoint(source, args.out_dir, parse_size(args.max_shard_size), args.overwrite, args.weights)
    except (ExportError, FinetuneError, ModelLoadError) as e:
        sys.exit(f"export failed: {e}")
    print(f"exported the {args.weights} weights of {source} -> {out} "
          f"({', '.join(sorted(os.listdir(out)))})")


if __name__ == "__main__":
    main()
