"""Fine-tune start: load weights only, from one of our checkpoints or an exported folder (and the
weights of a resume with resume.reset_optimizer, `load_resume_weights`).

`finetune.checkpoint_path` may be
- a `checkpoint_step_N/` folder: the module weights in `engine/mp_rank_00_model_states.pt`
  (DeepSpeed; under ZeRO-1/2 these are the model's own weights: exact in fp32, the bf16
  copy under bf16_mixed) or `engine/model.pt` (DDP);
- an exported folder (`python -m checkpoint.export`, `python -m models.convert_motus`): `config.json`
  + `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`;
- a Motus checkpoint folder (`mp_rank_00_model_states.pt` or `pytorch_model/mp_rank_00_model_states.pt`,
  Motus's `{'module': ...}`): converted in memory as `python -m models.convert_motus` does.
A checkpoint trained with `training.ema.enabled` also holds the EMA of the trainable weights
(`engine/ema_rank_R.pt` slices under ZeRO-1/2, `engine/ema.pt` otherwise): `read_weights(path,
weights="ema")` returns that set, and `inference_weights` picks it by default for evaluation.
Missing and unexpected keys are logged. A key whose shape changed is skipped (left at its
fresh init) only when a `finetune.allow_shape_mismatch` regex matches its whole name (for a
new action_dim: `action_expert\\.(action_encoder\\.0|proj_out)\\..*`); otherwise it is an
error. A path that does not load, or a checkpoint that shares no tensor with the model, is
an error: never a silent random initialisation.
"""
import logging
import os
import re
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, List, Tuple

import torch

from checkpoint.checkpointer import MARKER, quick_check
from checkpoint.manifest import check_digests
from checkpoint.files import DDP_MODEL_FILE, DEEPSPEED_MODEL_FILE, EMA_FILE, EMA_SHARD_FILE, ENGINE_DIR, rank_pattern
from checkpoint.zero import CheckpointConvertError, ShardReader, master_weights
from models.convert_motus import MOTUS_LAYOUTS, MotusConvertError, convert_for_model, motus_states_file
from models.serialization import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, read_config, read_state_dict

if TYPE_CHECKING:
    from models.world_model import WorldModel

log = logging.getLogger(__name__)

DEEPSPEED_WEIGHTS = os.path.join(ENGINE_DIR, DEEPSPEED_MODEL_FILE)
DDP_WEIGHTS = os.path.join(ENGINE_DIR, DDP_MODEL_FILE)
WEIGHT_SETS = ("raw", "ema")
EXPECTED = (f"a checkpoint_step_N folder (with {DEEPSPEED_WEIGHTS} or {DDP_WEIGHTS}), an exported "
            f"folder ({CONFIG_NAME} + {WEIGHTS_NAME}, or shards + {INDEX_NAME}) or a Motus checkpoint "
            f"folder ({' or '.join(MOTUS_LAYOUTS)})")


class FinetuneError(RuntimeError):
    """Weights that cannot start a fine-tune: the message names the path, the key and what was expected."""


@dataclass
class FinetuneReport:
    source: str
    loaded: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    """In the model, not in the checkpoint: left at their fresh init."""
    unexpected: List[str] = field(default_factory=list)
    """In the checkpoint, not in the model: ignored."""
    skipped: List[Tuple[str, tuple, tuple]] = field(default_factory=list)
    """(key, checkpoint shape, model shape) of keys skipped under allow_shape_mismatch."""

    def summary(self) -> str:
        lines = [f"fine-tune weights from {self.source}: {len(self.loaded)} tensors loaded"]
        if self.missing:
            lines.append(f"  missing (fresh init): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected (ignored): {', '.join(self.unexpected)}")
        for key, saved, current in self.skipped:
            lines.append(f"  shape changed, allowed (fresh init): {key} {saved} -> {current}")
        return "\n".join(lines)


def _load_torch(path: str, key: str) -> Any:  # whatever the file holds: its callers check
    try:
        # weights only: fine-tune paths may come from elsewhere, and these files hold only tensors
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # name the file; torch's message says what broke
        raise FinetuneError(f"{key}: could not load '{path}': {e}") from e


def has_ema(path: str) -> bool:
    """Whether `path` is a checkpoint folder that holds EMA weights."""
    engine = os.path.join(path, ENGINE_DIR)
    return any(os.path.isfile(os.path.join(engine, f)) for f in (EMA_FILE, EMA_SHARD_FILE.format(rank=0)))


def read_ema(path: str, key: str) -> tuple[int, dict[str, torch.Tensor]]:
    """(EMA updates, {name: fp32 tensor}) of the trainable weights of checkpoint `path`."""
    engine = os.path.join(path, ENGINE_DIR)
    if not has_ema(path):
        whole, first = (os.path.join(ENGINE_DIR, f) for f in (EMA_FILE, EMA_SHARD_FILE.format(rank=0)))
        raise FinetuneError(f"{key} '{path}' holds no EMA weights (neither {whole} nor {first}: trained without "
                            "training.ema.enabled); use the raw weights (--weights raw)")
    complete = os.path.isfile(os.path.join(path, MARKER))  # a checkpoint: its manifest lists the EMA files
    for name in sorted(os.listdir(engine)) if complete else ():
        if name == EMA_FILE or re.fullmatch(rank_pattern(EMA_SHARD_FILE), name):
            _verify_weights(path, os.path.join(ENGINE_DIR, name), key)
    if os.path.isfile(os.path.join(engine, EMA_FILE)):
        saved = _load_torch(os.path.join(engine, EMA_FILE), key)
        return int(saved["updates"]), saved["weights"]
    try:
        reader = ShardReader(engine)
        return int(reader.ema_updates()), {name: reader.full(name, "ema") for name in reader.where}
    except CheckpointConvertError as e:
        raise FinetuneError(f"{key}: {e}") from e


def read_weights(path: str, key: str = "finetune.checkpoint_path", weights: str = "raw") -> dict[str, torch.Tensor]:
    """The model weights at `path` as {name: tensor} (see the module docstring for the layouts);
    `key` names the setting or argument the path came from, for the error messages.

    weights="ema": a checkpoint's EMA set: its trainable tensors replaced by their EMA (in the
    module weights' dtype), the rest (buffers) as saved; an error where the checkpoint has none."""
    if weights not in WEIGHT_SETS:
        raise FinetuneError(f"{key}: weights '{weights}'; expected one of {', '.join(WEIGHT_SETS)}")
    raw = _read_raw(path, key)
    if weights == "raw":
        return raw
    updates, ema = read_ema(path, key)
    if updates == 0:
        raise FinetuneError(f"{key} '{path}': the EMA has had no update yet (training.ema.start_step comes "
                            "after this checkpoint's step); use the raw weights (--weights raw)")
    unknown = sorted(set(ema) - set(raw))
    if unknown:
        raise FinetuneError(f"{key} '{path}': EMA tensors {unknown[:5]} are not in the module weights")
    return {**raw, **{name: value.to(raw[name].dtype) for name, value in ema.items()}}


def inference_weights(path: str, weights: str | None = None,
                      key: str = "checkpoint") -> tuple[dict[str, torch.Tensor], str, str]:
    """For evaluation and serving: (state dict, the set it is: "ema" or "raw", a sentence saying so).

    weights=None picks the EMA set when the checkpoint at `path` has one, else the raw weights.
    An exported folder holds one set, the one its config.json names ("weights")."""
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        exported = read_config(path).get("weights", "raw")
        if weights not in (None, exported):
            raise FinetuneError(f"{key} '{path}' is an export of the {exported} weights; the {weights} set "
                                "is in the checkpoint_step_N folder it was exported from")
        return read_weights(path, key), exported, f"using the {exported} weights exported in {path}"
    averaged = has_ema(path) and read_ema(path, key)[0] > 0  # an EMA before its first update is no average
    chosen = weights or ("ema" if averaged else "raw")
    state = read_weights(path, key, chosen)
    if chosen == "ema":
        note = "its EMA weights (--weights raw for the raw ones)"
    elif averaged:
        note = "its raw weights (it also holds EMA weights: --weights ema)"
    else:
        note = "its raw weights" + (" (its EMA has had no update yet)" if has_ema(path) else " (it holds no EMA weights)")
    return state, chosen, f"using {note} from {path}"


def _read_raw(path: str, key: str) -> dict[str, torch.Tensor]:
    if not os.path.exists(path):
        raise FinetuneError(f"{key} '{path}' does not exist; expected {EXPECTED}")
    if not os.path.isdir(path):
        raise FinetuneError(f"{key} '{path}' is a file; expected {EXPECTED}")
    in_checkpoint = [f for f in (DEEPSPEED_WEIGHTS, DDP_WEIGHTS) if os.path.isfile(os.path.join(path, f))]
    if in_checkpoint and not os.path.isfile(os.path.join(path, MARKER)):
        raise FinetuneError(f"{key} '{path}' has no {MARKER} marker: its save was interrupted; "
                            "pick a complete checkpoint")
    if in_checkpoint:
        _verify_weights(path, in_checkpoint[0], key)
    if os.path.isfile(os.path.join(path, DEEPSPEED_WEIGHTS)):
        saved = _load_torch(os.path.join(path, DEEPSPEED_WEIGHTS), key)
        if not isinstance(saved, dict) or not isinstance(saved.get("module"), dict):
            raise FinetuneError(f"'{os.path.join(path, DEEPSPEED_WEIGHTS)}' has no 'module' weights; "
                                "expected a file written by DeepSpeed's save_checkpoint")
        return saved["module"]
    if os.path.isfile(os.path.join(path, DDP_WEIGHTS)):
        return _load_torch(os.path.join(path, DDP_WEIGHTS), key)
    if any(os.path.isfile(os.path.join(path, f)) for f in (WEIGHTS_NAME, INDEX_NAME)):
        try:
            return read_state_dict(path)
        except Exception as e:  # a truncated or foreign file: name the folder
            raise FinetuneError(f"{key}: could not read the weights in '{path}': {e}") from e
    raise FinetuneError(f"{key} '{path}' holds no weights; expected {EXPECTED}")


def _verify_weights(path: str, rel: str, key: str) -> None:
    """The weights file against the checkpoint's manifest (size and checksum): only that file, so a
    fine-tune or an export does not read the optimizer state it does not need."""
    manifest, problems = quick_check(path)  # manifest None: damaged or of another format (problems say so)
    if manifest is not None:
        problems = [p for p in problems if p.startswith(os.path.join(path, rel))]
        problems = problems or check_digests(path, manifest, [rel])
    if problems:
        raise FinetuneError(f"{key} '{path}' fails verification: {'; '.join(problems)}; pick another "
                            "checkpoint (python -m checkpoint verify lists every damaged file)")


def _read_motus(model: "WorldModel", path: str, allow_shape_mismatch: Sequence[str]) -> dict[str, torch.Tensor]:
    """A Motus checkpoint folder, converted for `model`; what was dropped and what starts fresh is logged."""
    try:
        state, report = convert_for_model(path, model, allow_shape_mismatch, key="finetune.checkpoint_path")
    except MotusConvertError as e:
        raise FinetuneError(f"finetune.checkpoint_path: {e}") from e
    log.warning(report.summary())
    return state


def _allowed(key: str, patterns: Iterable[str]) -> bool:
    return any(re.fullmatch(p, key) for p in patterns)


@torch.no_grad()
def load_finetune_weights(model: "WorldModel", path: str, allow_shape_mismatch: Sequence[str] = ()) -> FinetuneReport:
    """Copy the weights at `path` into `model` (in place); returns a FinetuneReport (also logged)."""
    saved = _read_motus(model, path, allow_shape_mismatch) if motus_states_file(path) else read_weights(path)
    current = model.state_dict()
    report = FinetuneReport(source=path)
    wrong: list[tuple[str, tuple, tuple]] = []
    for key, tensor in saved.items():
        if key not in current:
            report.unexpected.append(key)
        elif tensor.shape != current[key].shape:
            entry = (key, tuple(tensor.shape), tuple(current[key].shape))
            (report.skipped if _allowed(key, allow_shape_mismatch) else wrong).append(entry)
        else:
            report.loaded.append(key)
    if wrong:
        listed = "; ".join(f"{k}: checkpoint {a}, model {b}" for k, a, b in wrong)
        raise FinetuneError(f"'{path}': shapes differ from the model's and no finetune.allow_shape_mismatch "
                            f"pattern allows it: {listed}. Add a pattern matching the whole key "
                            "(e.g. 'action_expert\\.proj_out\\..*') to start those tensors fresh")
    if not report.loaded:
        raise FinetuneError(f"'{path}' shares no tensor with the model (checkpoint keys such as "
                            f"{sorted(saved)[:3]}, model keys such as {sorted(current)[:3]}): "
                            "refusing to fine-tune from random weights")
    report.missing = sorted(set(current) - set(saved))
    model.load_state_dict({k: saved[k] for k in report.loaded}, strict=False)
    (log.warning if report.missing or report.unexpected or report.skipped else log.info)(report.summary())
    return report


def load_resume_weights(model: torch.nn.Module, path: str) -> None:
    """The trainable weights of checkpoint `path` into `model`, before the engine is built (its fp32
    masters are made from them): the ZeRO fp32 masters where the checkpoint has them, else the
    module weights (DDP, stage 0: fp32)."""
    weights = {**read_weights(path, "resume.checkpoint_path"), **master_weights(os.path.join(path, ENGINE_DIR))}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable - set(weights))
    if missing:
        raise ValueError(f"resume.checkpoint_path '{path}' lacks the trainable weights {missing[:5]}: "
                         "resume needs the same model")
    model.load_state_dict({k: v for k, v in weights.items() if k in model.state_dict()}, strict=False)
