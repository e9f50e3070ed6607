"""Motus checkpoints as WorldModel weights: `python -m models.convert_motus SRC --config CFG --out DIR`.

SRC is a Motus checkpoint folder (`mp_rank_00_model_states.pt`, or `pytorch_model/mp_rank_00_model_states.pt`
as Motus's `load_pretrain_weights` also accepts) or that file: `{'module': Motus.state_dict()}`. What
happens to its tensors:
- `video_model.wan_model.*` (native Wan names) -> `video.*` through diffusers' own converter;
- `action_expert.*`, `und_expert.*` -> ours, renamed; each `wan_*_qkv [3, heads, dim, head_dim]` splits
  into `to_q/to_k/to_v` weights; the action-token position table is taken as saved (bf16-rounded);
- dropped: `vlm_model.*` (the frozen Qwen3-VL: ours loads from `model.vlm.checkpoint_path`) and the
  duplicates that Motus's wrapper modules register (`video_module.*`, `action_module.*`, `und_module.*`).
A pretrain-mode checkpoint (Motus stage 2: no state encoder, no registers) loaded into a fine-tune-mode
model keeps Motus's rule (`Motus.load_pretrain_weights`): the action encoder and decoder start fresh
too, with the state encoder, the registers and the position table. DIR is written like an export
(`python -m checkpoint.export`: config.json + sharded safetensors) and holds only the converted
tensors; `finetune.checkpoint_path: DIR` (or the Motus folder itself) starts a run from it.
"""
import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List

import torch

from models.config import ModelConfig

if TYPE_CHECKING:  # imported by main(): diffusers is slow to import
    from models.world_model import WorldModel

log = logging.getLogger(__name__)

MOTUS_STATES = "mp_rank_00_model_states.pt"
MOTUS_LAYOUTS = (MOTUS_STATES, os.path.join("pytorch_model", MOTUS_STATES))
WAN_PREFIX, VLM_PREFIX = "video_model.wan_model.", "vlm_model."
WRAPPER_PREFIXES = ("video_module.", "action_module.", "und_module.")
# Motus.load_pretrain_weights skips these when a fine-tune run starts from a pretrain checkpoint
PRETRAIN_SKIPPED = ("action_expert.input_encoder.", "action_expert.decoder.")

# (Motus name pattern, ours), applied to the names under action_expert. / und_expert.
EXPERT_RENAMES = [
    (r"input_encoder\.(state_encoder|action_encoder)\.", r"\1."),
    (r"input_encoder\.pos_embedding$", "positions"),
    (r"time_embedding\.", "time_embedder."),
    (r"time_projection\.", "time_proj."),
    (r"blocks\.(\d+)\.wan_(?:action|und)_o\.", r"layers.\1.to_out."),
    (r"blocks\.(\d+)\.wan_(?:action|und)_norm_([qk])\.", r"layers.\1.norm_\2."),
    (r"blocks\.(\d+)\.(ffn\.|modulation$)", r"layers.\1.\2"),
    (r"decoder\.modulation$", "out_modulation"),
    (r"decoder\.action_head\.0\.", "proj_out."),
    (r"vlm_adapter\.", "adapter."),
    (r"registers$", "registers"),
]
POSITIONS = "action_expert.positions"
QKV = re.compile(r"blocks\.(\d+)\.wan_(?:action|und)_qkv$")


class MotusConvertError(RuntimeError):
    """A Motus checkpoint that does not fit: the message names the key and both shapes."""


@dataclass
class ConversionReport:
    source: str
    finetune_mode: bool
    converted: int = 0
    dropped: Dict[str, int] = field(default_factory=dict)
    """Why -> how many checkpoint tensors were left out."""
    fresh: List[str] = field(default_factory=list)
    """Model tensors the checkpoint does not provide: they start from their fresh init."""
    notes: List[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"Motus checkpoint {self.source} ({'fine-tune' if self.finetune_mode else 'pretrain'} mode): "
                 f"{self.converted} tensors converted"]
        lines += [f"  dropped {n}: {why}" for why, n in self.dropped.items()]
        lines += [f"  {note}" for note in self.notes]
        if self.fresh:
            lines.append(f"  not in the checkpoint, start fresh: {', '.join(self.fresh)}")
        return "\n".join(lines)


def motus_states_file(path: str) -> str | None:
    """The `mp_rank_00_model_states.pt` of a Motus checkpoint at `path` (folder or file), else None.
    Our own checkpoints keep theirs under engine/ and are not matched."""
    if os.path.isfile(path) and os.path.basename(path) == MOTUS_STATES:
        return path
    for layout in MOTUS_LAYOUTS if os.path.isdir(path) else ():
        if os.path.isfile(os.path.join(path, layout)):
            return os.path.join(path, layout)
    return None


def read_motus_state(path: str, key: str = "SRC") -> dict[str, torch.Tensor]:
    file = motus_states_file(path)
    if file is None:
        raise MotusConvertError(f"{key} '{path}' is not a Motus checkpoint: expected a folder with "
                                f"{' or '.join(MOTUS_LAYOUTS)}, or that file")
    try:  # weights only: a checkpoint from elsewhere must not run code; mmap: 5B in bf16 is ~11 GB
        saved = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:
        raise MotusConvertError(f"{key}: could not load '{file}': {e}") from e
    if not isinstance(saved, dict) or not isinstance(saved.get("module"), dict):
        raise MotusConvertError(f"'{file}' has no 'module' state dict; expected Motus's {{'module': ...}}")
    if not any(k.startswith(WAN_PREFIX) for k in saved["module"]):
        raise MotusConvertError(f"'{file}' has no '{WAN_PREFIX}*' tensors: not a Motus model state")
    return saved["module"]


def _expert_name(rest: str) -> str | None:
    for pattern, replacement in EXPERT_RENAMES:
        if re.match(pattern, rest):
            return re.sub(pattern, replacement, rest, count=1)
    return None


def _split_qkv(tensor: torch.Tensor) -> list[torch.Tensor]:
    """[3, heads, dim, head_dim] (Motus's einsum layout) -> three nn.Linear weights [heads * head_dim, dim]."""
    return [t.permute(0, 2, 1).reshape(-1, t.shape[1]) for t in tensor.unbind(0)]


def convert_state_dict(motus: Mapping[str, torch.Tensor]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, int]]:
    """Motus names -> ours. Returns ({ours: tensor}, {ours: motus name}, {reason: count})."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    ours: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    dropped: dict[str, int] = {}
    wan: dict[str, torch.Tensor] = {}
    for name, tensor in motus.items():
        if name.startswith(WAN_PREFIX):
            wan[name[len(WAN_PREFIX):]] = tensor
            continue
        head, _, rest = name.partition(".")
        if name.startswith(VLM_PREFIX) or name.startswith(WRAPPER_PREFIXES):
            why = ("the frozen Qwen3-VL (vlm_model.*; ours loads model.vlm.checkpoint_path)"
                   if name.startswith(VLM_PREFIX) else
                   "duplicates registered by Motus's wrapper modules (video_module, action_module, und_module)")
            dropped[why] = dropped.get(why, 0) + 1
            continue
        qkv = QKV.match(rest) if head in ("action_expert", "und_expert") else None
        if qkv:
            for proj, weight in zip(("to_q", "to_k", "to_v"), _split_qkv(tensor)):
                key = f"{head}.layers.{qkv.group(1)}.{proj}.weight"
                ours[key], origin[key] = weight, name
            continue
        renamed = _expert_name(rest) if head in ("action_expert", "und_expert") else None
        if renamed is None:
            raise MotusConvertError(f"Motus checkpoint key '{name}' is not one this converter knows; "
                                    "is it a checkpoint of a newer Motus?")
        ours[f"{head}.{renamed}"], origin[f"{head}.{renamed}"] = tensor, name
    native_names = {id(t): n for n, t in wan.items()}
    for key, tensor in convert_wan_transformer_to_diffusers(dict(wan)).items():
        ours[f"video.{key}"], origin[f"video.{key}"] = tensor, WAN_PREFIX + native_names.get(id(tensor), key)
    return ours, origin, dropped


def fit_to_model(motus: Mapping[str, torch.Tensor], model_state: Mapping[str, torch.Tensor], finetune_mode: bool,
                 source: str, allow_shape_mismatch: Iterable[str] = ()
                 ) -> tuple[dict[str, torch.Tensor], ConversionReport]:
    """The converted tensors that `model_state` ({name: tensor}, shapes only) takes, and the report.
    Raises MotusConvertError naming the key and both shapes when a dim differs."""
    ckpt_finetune = any(k.startswith("action_expert.input_encoder.state_encoder.") for k in motus)
    report = ConversionReport(source=source, finetune_mode=ckpt_finetune)
    if ckpt_finetune and not finetune_mode:
        raise MotusConvertError(f"{source} is a fine-tune-mode Motus checkpoint (state encoder, registers) "
                                "but the config's model.mode is pretrain; use model.mode: finetune")
    if finetune_mode and not ckpt_finetune:
        skipped = [k for k in motus if k.startswith(PRETRAIN_SKIPPED)]
        motus = {k: v for k, v in motus.items() if not k.startswith(PRETRAIN_SKIPPED)}
        report.dropped["action encoder/decoder of a pretrain-mode checkpoint (as Motus.load_pretrain_weights)"] = \
            len(skipped)
        report.notes.append("pretrain-mode checkpoint (Motus stage 1/2) into model.mode finetune: the state "
                            "encoder, action encoder, registers, position table and action decoder start fresh")
    ours, origin, dropped = convert_state_dict(motus)
    report.dropped.update(dropped)
    state, wrong = {}, []
    table = ours.get(POSITIONS)
    if table is not None and POSITIONS in model_state and table.shape[1] > model_state[POSITIONS].shape[1]:
        # Motus's fine-tune table has one row more than its tokens (the state is counted twice);
        # it adds pos_embedding[:, :seq_len], so the rows past our token count are never read
        ours[POSITIONS] = table[:, :model_state[POSITIONS].shape[1]]
    for key, tensor in ours.items():
        if key not in model_state:
            raise MotusConvertError(f"Motus key '{origin[key]}' (ours '{key}') has no place in the config's model")
        if tuple(tensor.shape) != tuple(model_state[key].shape):
            if any(re.fullmatch(p, key) for p in allow_shape_mismatch):
                report.dropped[f"shape differs, allowed: {key}"] = 1
                continue
            wrong.append(f"'{origin[key]}' (ours '{key}'): checkpoint {tuple(tensor.shape)}, "
                         f"config {tuple(model_state[key].shape)}")
            continue
        state[key] = tensor
    if wrong:
        raise MotusConvertError(f"{source} does not fit the config's model: {'; '.join(wrong)}. Set the "
                                "config's dims (model.size, common.action_dim/state_dim, the experts' "
                                "hidden_size) to the checkpoint's, or allow the key to start fresh")
    report.converted = len(state)
    report.fresh = sorted(set(model_state) - set(state))
    return state, report


def settings_differences(path: str, settings: ModelConfig) -> list[str]:
    """What the `config.json` Motus's trainer writes beside a checkpoint says differently from `settings`
    (our `model` section) about what no tensor shape shows: the experts' norm epsilons."""
    file = motus_states_file(path)
    assert file is not None, f"'{path}' is not a Motus checkpoint"  # callers read its state first
    folder = os.path.dirname(file)
    candidates = [os.path.join(d, "config.json") for d in (folder, os.path.dirname(folder))]
    found = next((c for c in candidates if os.path.isfile(c)), None)
    if found is None:
        return []
    try:
        with open(found) as f:
            motus_cfg = json.load(f)
    except (OSError, ValueError):
        return [f"{found} is not readable JSON: the experts' norm_eps could not be compared"]
    notes = []
    for expert in ("action_expert", "und_expert"):
        theirs = (motus_cfg.get(expert) or {}).get("norm_eps") if isinstance(motus_cfg, dict) else None
        ours = getattr(settings, expert).norm_eps
        if theirs is not None and float(theirs) != ours:
            notes.append(f"{found} has {expert}.norm_eps {theirs}, the config model.{expert}.norm_eps {ours}: "
                         f"set model.{expert}.norm_eps: {theirs} to compute Motus's function")
    return notes


def convert_for_model(path: str, model: "WorldModel", allow_shape_mismatch: Iterable[str] = (),
                      key: str = "SRC") -> tuple[dict[str, torch.Tensor], ConversionReport]:
    """Read the Motus checkpoint at `path` and convert it for `model` (a WorldModel; may be on meta)."""
    state, report = fit_to_model(read_motus_state(path, key), model.state_dict(),
                                 model.settings.reads_state, path, allow_shape_mismatch)
    report.notes += settings_differences(path, model.settings)
    return state, report


def main(argv: Sequence[str] | None = None) -> None:
    from accelerate import init_empty_weights

    from data.errors import DataError
    from models.folder import ExportError, check_out_dir, model_spec_from_config, parse_size
    from models.serialization import DEFAULT_SHARD_BYTES, ModelLoadError, save_state
    from models.world_model import WorldModel
    from recipe.config import load_config
    from recipe.generated import ensure_generated_inputs
    from utils.config import ConfigError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a Motus checkpoint folder or its mp_rank_00_model_states.pt")
    parser.add_argument("--config", required=True, help="the recipe YAML whose model the weights must fit")
    parser.add_argument("--out", required=True, help="the folder to write (must be empty unless --overwrite)")
    parser.add_argument("--allow-shape-mismatch", action="append", default=[], metavar="REGEX",
                        help="our key names (whole match) that may differ in shape: left out, start fresh")
    parser.add_argument("--max-shard-size", default=f"{DEFAULT_SHARD_BYTES // 2 ** 30}GiB")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_intermixed_args(argv)  # overrides anywhere on the line, as train.py takes them
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        ensure_generated_inputs(cfg, dataset=False)  # the parts' config files give the architecture
        spec = model_spec_from_config(cfg)  # with `common`, as checkpoint.export writes it
        with init_empty_weights():  # shapes only: every tensor written comes from the checkpoint
            model = WorldModel(spec).apply_precision()
        state, report = convert_for_model(args.src, model, args.allow_shape_mismatch)
        max_shard = parse_size(args.max_shard_size)
        check_out_dir(args.out, args.overwrite)
    except (MotusConvertError, ExportError, ModelLoadError, ConfigError, DataError) as e:
        sys.exit(f"convert_motus failed: {e}")
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}  # as the config's precision holds them
    save_state(spec, {k: v.to(dtypes[k]) for k, v in state.items()}, args.out, max_shard)
    print(report.summary())
    print(f"wrote {args.out} ({', '.join(sorted(os.listdir(args.out)))}); start a run from it with "
          f"finetune.checkpoint_path={args.out}")


if __name__ == "__main__":
    main()
