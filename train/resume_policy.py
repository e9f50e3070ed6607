"""What every config key does when a run is resumed with an edited YAML: one table, one check.

`check(cfg, checkpoint, world_size)` compares the run's config with the checkpoint's
`config.yaml` before anything is built. Each changed key is decided by the first rule of
`RULES` whose pattern matches it:
- takes effect: used from the resumed step on (optimizer hyperparameters reach the loaded
  param groups through optim/hyperparameters.py);
- takes effect, logged: used, and the log says what that changes;
- refused: the run stops before any step, naming the key and both values, unless the switch
  the rule names (`resume.reset_optimizer`, `resume.reset_scheduler`) is on.
Every leaf key of the schema matches a rule (tests/test_resume_edits.py); TRAINING.md lists the
table (`python -m train.resume_policy`).
"""
import fnmatch
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from checkpoint.checkpointer import saved_world_size
from checkpoint.files import CONFIG_YAML

EFFECT, LOGGED, REFUSED = "takes effect", "takes effect, logged", "refused"
DATA = ("the data changes: the stream continues at the same sample number, drawn from the new data, "
        "with normalisation statistics computed (or read) anew")
BATCH = "the data position is kept in samples: the stream continues at the first sample not yet drawn"
ARCHITECTURE = "the checkpoint's weights have the saved architecture and shapes"
SPLIT = "the saved optimizer state belongs to the saved param groups"
FINETUNE = "; use finetune.checkpoint_path to start a new run from these weights"


@dataclass(frozen=True)
class Rule:
    pattern: str
    """fnmatch pattern over dotted config keys."""
    behaviour: str
    note: str = ""
    """Why a key is refused, or what a logged change does."""
    unless: Optional[str] = None
    """A refusal is lifted when this boolean config key is true."""
    same: Optional[Callable] = None
    """same(old, new): a change this returns True for is no change (it takes effect)."""


def _weights_kept(old: str, new: str) -> bool:
    """fp32 and fp32_mixed both keep fp32 weights and optimizer state; bf16_mixed keeps others."""
    return (old == "bf16_mixed") == (new == "bf16_mixed")


def _same_split(old: int, new: int) -> bool:
    """moe_num_experts 1 has no "muon_experts" group, more than 1 has one: the split changes."""
    return (old > 1) == (new > 1)


# First match wins: specific patterns before the section-wide ones.
RULES = (
    Rule("common.*", REFUSED, "the model's input and output shapes and its training frames" + FINETUNE),
    Rule("dataset.cache_dir", EFFECT),
    Rule("dataset.cache_stride", EFFECT),
    Rule("dataset.skip_bad_samples", EFFECT),
    Rule("dataset.*", LOGGED, DATA),
    Rule("model.precision", REFUSED, "the saved weights and optimizer state are kept in the saved precision "
         "(fp32 <-> fp32_mixed takes effect)" + FINETUNE, same=_weights_kept),
    Rule("model.gradient_checkpointing", EFFECT),
    Rule("model.time_distribution.*", EFFECT),
    Rule("model.inference.*", EFFECT),
    Rule("model.loss_weights.*", EFFECT),
    Rule("model.*", REFUSED, ARCHITECTURE + FINETUNE),
    Rule("training.batch_size", LOGGED, BATCH),
    Rule("training.gradient_accumulation_steps", LOGGED, BATCH),
    Rule("training.global_batch_size", LOGGED, BATCH),
    Rule("training.optimizer", REFUSED, SPLIT, unless="resume.reset_optimizer"),
    Rule("training.muon.routing", REFUSED, SPLIT, unless="resume.reset_optimizer"),
    Rule("training.muon.include", REFUSED, SPLIT, unless="resume.reset_optimizer"),
    Rule("training.muon.exclude", REFUSED, SPLIT, unless="resume.reset_optimizer"),
    Rule("training.muon.moe_expert_pattern", REFUSED, SPLIT, unless="resume.reset_optimizer"),
    Rule("training.muon.moe_num_experts", REFUSED, SPLIT + " (1 has no muon_experts group; from one value "
         "above 1 to another it takes effect)", unless="resume.reset_optimizer", same=_same_split),
    Rule("training.scheduler_type", REFUSED, "the saved schedule position means something else in another "
         "schedule", unless="resume.reset_scheduler"),
    Rule("training.seed", LOGGED, "the data order and the training noise change from the resumed step on"),
    Rule("training.ema.enabled", LOGGED, "turned on: the EMA starts from a copy of the weights at its next "
         "update when the checkpoint holds none; turned off: the saved EMA is not carried on"),
    Rule("training.*", EFFECT),
    Rule("system.*", EFFECT),
    Rule("logging.*", EFFECT),
    Rule("resume.*", EFFECT),
    Rule("finetune.*", LOGGED, "read only when a run starts from scratch: a resumed run keeps its own weights"),
    Rule("serving.*", EFFECT),
    Rule("evaluation.*", LOGGED, "the evaluations from the resumed step on use it; the reports already in the "
         "checkpoints' folders stay as they are (not redone)"),
)
QUIET = ("resume.checkpoint_path",)  # what makes a run a resume: not an edit worth listing


class ResumeRefused(ValueError):
    """An edit the checkpoint cannot honour; the message names the key, both values and the way out."""


def rule_for(key: str) -> Rule:
    for rule in RULES:
        if fnmatch.fnmatchcase(key, rule.pattern):
            return rule
    raise KeyError(f"no resume rule covers config key {key!r}; add one to train/resume_policy.py RULES")


def leaves(cfg: DictConfig, prefix: str = "") -> dict[str, Any]:
    """{dotted key: plain value} of every leaf of a config (a list is one leaf)."""
    out = {}
    for key in cfg:
        node = cfg._get_node(key)
        dotted = f"{prefix}{key}"
        if OmegaConf.is_dict(node):
            out.update(leaves(node, dotted + "."))
        else:
            out[dotted] = OmegaConf.to_container(node) if OmegaConf.is_list(node) else node._value()
    return out


def changes(cfg: DictConfig, saved: DictConfig) -> list[tuple[str, Any, Any]]:
    """[(key, saved value, value now)] for the keys both configs have, in the schema's order."""
    old = leaves(saved)
    return [(key, old[key], new) for key, new in leaves(cfg).items()
            if key in old and old[key] != new and key not in QUIET]


@dataclass
class Edits:
    """What a resume changes: the one log line, and the consequences the log states."""
    changed: list[tuple[str, Any, Any]]
    """(key, saved value, value now) of every changed key (`changes`)."""
    notes: list[str]

    def line(self) -> str:
        if not self.changed:
            return "resume: no config change relative to the checkpoint's config.yaml"
        return "resume: " + "; ".join(f"{key} {_show(old)} -> {_show(new)}" for key, old, new in self.changed)


def _show(value: object) -> str:
    """A value as it is written in the YAML or on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _refused(rule: Rule, old: Any, new: Any, cfg: DictConfig) -> bool:
    if rule.behaviour != REFUSED or (rule.same is not None and rule.same(old, new)):
        return False
    return not (rule.unless and OmegaConf.select(cfg, rule.unless))


def _refusal(key: str, old: Any, new: Any, rule: Rule, path: str) -> str:
    way_out = f"set {rule.unless}=true, or" if rule.unless else "to resume,"
    return (f"{key} is {_show(new)} but the checkpoint was trained with {_show(old)} ({path}): {rule.note}; "
            f"{way_out} set {key}={_show(old)}")


def check(cfg: DictConfig, checkpoint: str, world_size: int) -> Edits:
    """Edits of `cfg` relative to `checkpoint`'s config.yaml; raises ResumeRefused for a refused one."""
    path = os.path.join(checkpoint, CONFIG_YAML)
    saved = OmegaConf.load(path)
    edits = changes(cfg, saved)
    refused = [_refusal(key, old, new, rule_for(key), path) for key, old, new in edits
               if _refused(rule_for(key), old, new, cfg)]
    if refused:
        raise ResumeRefused("cannot resume with this config: " + " | ".join(refused))
    notes = [f"{key}: {rule_for(key).note}" for key, _, _ in edits if rule_for(key).behaviour == LOGGED]
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    t, s, saved_world = cfg.training, saved.training, saved_world_size(checkpoint)
    before = s.batch_size * s.gradient_accumulation_steps * saved_world
    now = t.batch_size * t.gradient_accumulation_steps * world_size
    if before != now:
        notes.append(f"a step now takes {now} samples instead of {before} (batch_size x gradient_accumulation_steps "
                     f"x world size {t.batch_size} x {t.gradient_accumulation_steps} x {world_size}, saved "
                     f"{s.batch_size} x {s.gradient_accumulation_steps} x {saved_world}); the data stream continues "
                     f"at sample {state['samples_seen']}, the first one not yet drawn; the lr schedule, max_steps "
                     "and the intervals count steps")
    if cfg.resume.reset_optimizer:
        notes.append("resume.reset_optimizer: the weights are the checkpoint's, the optimizer starts fresh (no "
                     "moments or momentum, step count 0); the EMA starts again from a copy of the weights")
    return Edits(edits, notes)


def render() -> str:
    """The table for TRAINING.md."""
    rows = ["| keys | on resume | why / what the log says |", "|---|---|---|"]
    for rule in RULES:
        behaviour = rule.behaviour + (f" unless `{rule.unless}=true`" if rule.unless else "")
        rows.append(f"| `{rule.pattern}` | {behaviour} | {rule.note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(render())
