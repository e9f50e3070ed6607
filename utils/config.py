"""The typed config: one schema for YAML files, `key=value` overrides and code.

`load_config` merges a YAML file and command-line overrides onto the schema,
rejects unknown keys and wrong types with a message naming the file, the key and
the closest valid key, and fills the derived fields.
"""
import difflib
import os
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from data.config import DatasetConfig
from models.config import ModelConfig
from optim.config import MuonConfig


class ConfigError(ValueError):
    """A config that cannot run: the message says which file and key, and what was expected."""


@dataclass
class CommonConfig:
    action_dim: int = 14
    """Width of one robot action vector (or latent action in pretraining)."""
    state_dim: int = 14
    """Width of the robot state (proprioception) vector."""
    num_video_frames: int = 8
    """Predicted video frames F (the condition frame comes on top)."""
    video_height: int = 384
    """Frames are resized, keeping the aspect ratio and padding, to video_height x video_width."""
    video_width: int = 320
    """See video_height."""
    global_downsample_rate: int = 3
    """Raw frames between two action steps d."""
    video_action_freq_ratio: int = 2
    """Action steps per predicted video frame r."""
    action_chunk_size: Optional[int] = None
    """Derived: num_video_frames * video_action_freq_ratio. Never set by hand."""


@dataclass
class TrainingConfig:
    batch_size: int = 2
    """Micro batch per process."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer update; gradients are synchronised at the last one only."""
    global_batch_size: Optional[int] = None
    """If set, must equal batch_size * gradient_accumulation_steps * world size."""
    max_steps: int = 100
    """Optimizer steps."""
    learning_rate: float = 1e-4
    """Peak lr of every param group (Muon's is rescaled per shape by training.muon.adjust_lr_fn)."""
    weight_decay: float = 0.01
    """Decoupled weight decay of both halves of the optimizer."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: str = "muon_adamw"
    """adamw or muon_adamw."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    scheduler_type: str = "linear"
    """linear (Motus's), cosine or constant."""
    warmup_steps: int = 10
    """Updates of linear warmup (linear and cosine)."""
    cycle_length: int = 1000
    """linear: the step at which the multiplier reaches f_min."""
    f_start: float = 0.0
    """linear: lr multiplier before the first update (warmup starts here)."""
    f_max: float = 1.0
    """linear: lr multiplier at the end of warmup."""
    f_min: float = 0.1
    """linear: lr multiplier from cycle_length on."""
    min_lr: float = 0.0
    """cosine: the lr reached at max_steps."""
    grad_clip_norm: float = 1.0
    """Global gradient norm clip (DeepSpeed `gradient_clipping`); 0 disables."""
    seed: int = 42
    """Seeds initialisation, data order and the per-sample noise."""


@dataclass
class SystemConfig:
    checkpoint_dir: str = "./runs"
    """Runs live in {checkpoint_dir}/{config stem}/{run_name}/."""
    log_level: str = "INFO"
    """Python logging level of rank 0 (other ranks log warnings only)."""
    log_interval: int = 1
    """Steps between metrics records (and preemption checks)."""
    save_interval: int = 1000
    """Steps between checkpoints; the last step is always saved."""
    val_interval: int = 500
    """Steps between validations on the held-out episodes."""
    val_batches: int = 4
    """Batches per rank in each validation."""
    total_limit: Optional[int] = 3
    """Keep the newest N complete checkpoints; null keeps all."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host memory of batches (GPU runs)."""
    dist_timeout_minutes: int = 60
    """Process-group timeout: long enough for large checkpoint saves."""


@dataclass
class LoggingConfig:
    report_to: str = "tensorboard"
    """tensorboard, wandb, all or none."""
    wandb_project: str = "motus"
    """wandb project name."""
    wandb_mode: str = "online"
    """online, offline or disabled."""
    tensorboard_log_dir: str = "tensorboard_logs"
    """Relative to the run directory."""
    run_name: Optional[str] = None
    """null: a readable name built from the config."""


@dataclass
class ResumeConfig:
    checkpoint_path: Optional[str] = None
    """A checkpoint_step_N folder, a run folder, or `auto` (newest complete checkpoint of this run)."""
    reset_scheduler: bool = False
    """true: restart the lr schedule from step 0 instead of continuing it."""


@dataclass
class FinetuneConfig:
    checkpoint_path: Optional[str] = None
    """Weights only: a checkpoint_step_N folder or an exported folder."""
    allow_shape_mismatch: List[str] = field(default_factory=list)
    """Regex patterns of parameter names that may change shape (skipped, left at init)."""


@dataclass
class Config:
    common: CommonConfig = field(default_factory=CommonConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)


CHOICES = {
    "dataset.type": ("lerobot", "robotwin", "synthetic", "latent_action"),
    "dataset.normalization": ("mean_std", "min_max", "quantile", "none"),
    "dataset.data_mode": ("clean", "randomized", "both"),
    "dataset.task_mode": ("single", "multi"),
    "model.size": ("tiny", "small", "motus"),
    "model.mode": ("finetune", "pretrain"),
    "model.precision": ("fp32", "bf16_mixed", "fp32_mixed"),
    "model.time_distribution.timestep_sample_method": ("logit_normal", "uniform"),
    "model.und_expert.vlm.projector_type": ("mlp3x_silu",),
    "training.optimizer": ("adamw", "muon_adamw"),
    "training.scheduler_type": ("linear", "cosine", "constant"),
    "training.muon.ns_dtype": ("bfloat16", "float32"),
    "training.muon.ns_method": ("standard", "gram"),
    "training.muon.adjust_lr_fn": ("match_rms_adamw", "original"),
    "training.muon.routing": ("all_hidden", "action_expert_only"),
    "logging.report_to": ("tensorboard", "wandb", "all", "none"),
    "logging.wandb_mode": ("online", "offline", "disabled"),
    "system.log_level": ("DEBUG", "INFO", "WARNING", "ERROR"),
}

POSITIVE = (
    "common.action_dim", "common.state_dim", "common.num_video_frames", "common.video_height",
    "common.video_width", "common.global_downsample_rate", "common.video_action_freq_ratio",
    "training.batch_size", "training.gradient_accumulation_steps", "training.max_steps",
    "system.log_interval", "system.save_interval", "system.val_interval",
    "model.inference.num_inference_timesteps",
)

DERIVED = ("common.action_chunk_size",)


def _all_keys(node, prefix=""):
    keys = []
    for k in node.keys():
        full = f"{prefix}{k}"
        keys.append(full)
        child = node._get_node(k)
        if OmegaConf.is_dict(child) and not child._is_none():
            keys.extend(_all_keys(child, full + "."))
    return keys


def _closest(key, valid):
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not match:  # a typo in the last part only: compare leaf names within the section
        section, _, leaf = key.rpartition(".")
        siblings = [v for v in valid if v.rpartition(".")[0] == section]
        leaves = difflib.get_close_matches(leaf, [s.rpartition(".")[2] for s in siblings], n=1, cutoff=0.4)
        match = [f"{section}.{leaves[0]}" if section else leaves[0]] if leaves else []
    return f" Did you mean '{match[0]}'?" if match else ""


def _merge(schema, data, source):
    valid = _all_keys(schema)
    try:
        return OmegaConf.merge(schema, data)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = getattr(e, "msg", str(e)).splitlines()[0]
        if isinstance(e, ConfigKeyError):  # a key the schema does not have
            raise ConfigError(f"{source}: unknown key '{key}'.{_closest(key, valid)}") from None
        raise ConfigError(f"{source}: bad value for '{key}': {msg}") from None


def _parse_overrides(overrides):
    for item in overrides:
        if "=" not in item or item.startswith("=") or item.startswith("--"):
            raise ConfigError(f"command line: override '{item}' is not of the form key=value "
                              "(for example training.max_steps=50)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"command line: cannot parse overrides {list(overrides)}: {e}") from None


def _check(cfg, source):
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{source}: '{key}' is {value!r}; expected one of {', '.join(allowed)}")
    for key in POSITIVE:
        value = OmegaConf.select(cfg, key)
        if value <= 0:
            raise ConfigError(f"{source}: '{key}' is {value}; expected a positive integer")
    for key in DERIVED:
        if OmegaConf.select(cfg, key) is not None:
            raise ConfigError(f"{source}: '{key}' is derived (num_video_frames * "
                              "video_action_freq_ratio); remove it from the config")
    rp = cfg.resume.checkpoint_path
    if rp is not None and cfg.finetune.checkpoint_path is not None:
        raise ConfigError(f"{source}: 'resume.checkpoint_path' and 'finetune.checkpoint_path' are both "
                          "set; resume continues a run, finetune starts a new one from weights: pick one")


def load_config(path, overrides=()):
    """Load `path` (YAML), apply `key=value` overrides, validate and derive."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist")
    schema = OmegaConf.structured(Config)
    try:
        data = OmegaConf.load(path)
    except Exception as e:  # a YAML syntax error: name the file and the parser's position
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not OmegaConf.is_dict(data):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    cfg = _merge(schema, data, path)
    cfg = _merge(cfg, _parse_overrides(overrides), "command line")
    _check(cfg, path)
    cfg.common.action_chunk_size = cfg.common.num_video_frames * cfg.common.video_action_freq_ratio
    OmegaConf.set_readonly(cfg, True)
    return cfg


def save_config(cfg, path):
    """Write the resolved config (derived fields included) as YAML."""
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(cfg))


def config_stem(path):
    return os.path.splitext(os.path.basename(path))[0]
