"""Load the recipe: one schema (recipe/schema.py) for YAML files, `key=value` overrides and code,
and every check across its fields, run at load time before anything is built.

`load_config` merges a YAML file and command-line overrides onto the schema (utils/config.py
rejects unknown keys and wrong types), checks every value against the names its package allows
(model sizes, optimizers, schedules, ...) and every rule between fields, fills the derived fields
and returns a read-only config. Training and inference both read a recipe through this module; it
imports only the light `config` modules of data/, models/ and optim/ and data/sim_env.py's task
table (no torch, PyAV, diffusers, transformers or simulator), so checking a YAML costs milliseconds.
The rules that depend on how a run is launched (process count, --deepspeed, CUDA) are
train/launch_checks.py's `check_launch`.
"""
import os
import re
from typing import Iterable

from omegaconf import DictConfig, OmegaConf

from data.config import DATA_MODES, DATASET_TYPES, FRAME_LAYOUTS, NORMALIZATIONS, TASK_MODES
from data.sim_env import EVAL_SEEDS, TASKS, SimTaskError, installed_task
from models.config import MODEL_MODES, NOISE_LAWS, PRECISIONS, PROJECTOR_TYPES
from models.sizes import SIZES
from optim.config import ADJUST_LR_FNS, NS_DTYPES, NS_METHODS, OPTIMIZERS
from optim.routing import PRESETS
from recipe.schema import LOG_LEVELS, MATMUL_PRECISIONS, RUNNERS, Config
from utils.config import ConfigError, check_choice, load_structured, require
from utils.metrics import PROGRESS, REPORT_TO, WANDB_MODES
from utils.schedule import SCHEDULES

CHOICES = {
    "dataset.type": DATASET_TYPES,
    "dataset.normalization": NORMALIZATIONS,
    "dataset.data_mode": DATA_MODES,
    "dataset.task_mode": TASK_MODES,
    "dataset.frame_layout": FRAME_LAYOUTS,
    "model.size": tuple(SIZES),
    "model.mode": MODEL_MODES,
    "model.precision": PRECISIONS,
    "model.time_distribution.timestep_sample_method": NOISE_LAWS,
    "model.und_expert.vlm.projector_type": PROJECTOR_TYPES,
    "training.optimizer": OPTIMIZERS,
    "training.scheduler_type": SCHEDULES,
    "training.muon.ns_dtype": NS_DTYPES,
    "training.muon.ns_method": NS_METHODS,
    "training.muon.adjust_lr_fn": ADJUST_LR_FNS,
    "training.muon.routing": PRESETS,
    "logging.report_to": REPORT_TO,
    "logging.wandb_mode": WANDB_MODES,
    "logging.progress": PROGRESS,
    "system.log_level": LOG_LEVELS,
    "system.speed.matmul_precision": MATMUL_PRECISIONS,
    "evaluation.task": tuple(sorted(TASKS)),
    "evaluation.runner": RUNNERS,
}
"""Config key -> its allowed names, each from the light module of the package that implements them."""


POSITIVE_INTS = (
    "common.action_dim", "common.state_dim", "common.num_video_frames", "common.video_height",
    "common.video_width", "common.global_downsample_rate", "common.video_action_freq_ratio",
    "training.batch_size", "training.gradient_accumulation_steps", "training.max_steps",
    "training.max_nonfinite_steps",
    "training.muon.ns_steps", "training.muon.moe_num_experts", "training.muon.moe_top_k",
    "system.log_interval", "system.save_interval", "system.val_interval", "system.val_batches",
    "system.dist_timeout_minutes", "model.inference.num_inference_timesteps",
    "model.action_expert.ffn_dim_multiplier", "model.und_expert.ffn_dim_multiplier",
    "serving.max_batch_size",
    "training.ema.update_every",
    "evaluation.episodes", "evaluation.workers",
)

DERIVED = {"common.action_chunk_size": "num_video_frames * video_action_freq_ratio"}


def _check_speed(cfg: DictConfig, source: str) -> None:
    """Switch combinations that cannot work together (TRAINING.md, "Speed switches")."""
    sp = cfg.system.speed
    require(source, sp.bucket_cap_mb is None or sp.bucket_cap_mb > 0, "system.speed.bucket_cap_mb",
            sp.bucket_cap_mb, "null (torch's default) or a positive number of MB")
    require(source, sp.cuda_graphs_token_multiple >= 1, "system.speed.cuda_graphs_token_multiple",
            sp.cuda_graphs_token_multiple, "an integer >= 1")
    if sp.cuda_graphs and not sp.compile:
        raise ConfigError(f"{source}: 'system.speed.cuda_graphs' is true but 'system.speed.compile' is false; "
                          "CUDA graphs are captured inside the compiled layer (mode reduce-overhead): "
                          "set compile=true or cuda_graphs=false")
    if sp.cuda_graphs and cfg.model.gradient_checkpointing:
        raise ConfigError(f"{source}: 'system.speed.cuda_graphs' and 'model.gradient_checkpointing' are both "
                          "true; a CUDA graph keeps the activations of every captured layer in its own memory "
                          "pool, which undoes what checkpointing saves: turn one off")
    if sp.static_graph and cfg.training.gradient_accumulation_steps > 1:
        raise ConfigError(f"{source}: 'system.speed.static_graph' is true and 'training.gradient_accumulation_steps' "
                          f"is {cfg.training.gradient_accumulation_steps}; DDP's static graph cannot skip the "
                          "gradient all-reduce of the accumulation micro-steps (no_sync; torch stops with "
                          "'expect_autograd_hooks_ INTERNAL ASSERT FAILED'): set static_graph=false")
    if not sp.tf32 and sp.matmul_precision in ("high", "medium"):
        raise ConfigError(f"{source}: 'system.speed.matmul_precision' is {sp.matmul_precision} (TF32 or bf16 "
                          "matmuls) but 'system.speed.tf32' is false; set matmul_precision to highest or null, "
                          "or tf32=true")


def _check_values(cfg: DictConfig, source: str) -> None:
    """Every rule on one field or between fields; the first broken one raises."""
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None:  # null: the key's documented default behaviour
            check_choice(source, key, value, allowed)
    for key in POSITIVE_INTS:
        value = OmegaConf.select(cfg, key)
        require(source, value > 0, key, value, "a positive integer")
    for key, formula in DERIVED.items():
        if OmegaConf.select(cfg, key) is not None:
            raise ConfigError(f"{source}: '{key}' is derived ({formula}); remove it from the config")
    t, m, td = cfg.training, cfg.training.muon, cfg.model.time_distribution
    rules = [
        (t.learning_rate > 0, "training.learning_rate", t.learning_rate, "a positive number"),
        (0 <= t.min_lr <= t.learning_rate, "training.min_lr", t.min_lr, "between 0 and training.learning_rate"),
        (t.weight_decay >= 0, "training.weight_decay", t.weight_decay, "a number >= 0"),
        (len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "training.betas", list(t.betas),
         "two numbers in [0, 1)"),
        (t.eps > 0, "training.eps", t.eps, "a positive number"),
        (t.grad_clip_norm >= 0, "training.grad_clip_norm", t.grad_clip_norm, "a number >= 0 (0 disables)"),
        (t.warmup_steps >= 0, "training.warmup_steps", t.warmup_steps, "an integer >= 0"),
        (t.scheduler_type != "linear" or t.warmup_steps < t.cycle_length, "training.warmup_steps",
         t.warmup_steps, f"smaller than training.cycle_length ({t.cycle_length}) for scheduler_type linear"),
        (min(t.f_start, t.f_max, t.f_min) >= 0, "training.f_start/f_max/f_min",
         [t.f_start, t.f_max, t.f_min], "multipliers >= 0"),
        (0 <= m.momentum < 1, "training.muon.momentum", m.momentum, "a number in [0, 1)"),
        (len(m.ns_coefficients) == 3, "training.muon.ns_coefficients", list(m.ns_coefficients),
         "three numbers (a, b, c)"),
        (0 <= t.ema.decay < 1, "training.ema.decay", t.ema.decay, "a number in [0, 1)"),
        (t.ema.start_step >= 0, "training.ema.start_step", t.ema.start_step, "an integer >= 0"),
        (m.muon_lr_scale > 0, "training.muon.muon_lr_scale", m.muon_lr_scale, "a positive number"),
        (m.moe_top_k <= m.moe_num_experts, "training.muon.moe_top_k", m.moe_top_k,
         f"at most training.muon.moe_num_experts ({m.moe_num_experts})"),
        (0 <= td.min_t <= td.max_t <= 1, "model.time_distribution.min_t/max_t", [td.min_t, td.max_t],
         "0 <= min_t <= max_t <= 1"),
        (td.shift > 0, "model.time_distribution.shift", td.shift, "a positive number"),
        (td.action_shift is None or td.action_shift > 0, "model.time_distribution.action_shift", td.action_shift,
         "null (the shared shift) or a positive number"),
        (0 <= td.marginal_video_fraction <= 1, "model.time_distribution.marginal_video_fraction",
         td.marginal_video_fraction, "a number in [0, 1]"),
        (cfg.model.action_expert.position_scale > 0, "model.action_expert.position_scale",
         cfg.model.action_expert.position_scale, "a positive number"),
        (td.sigmoid_scale > 0, "model.time_distribution.sigmoid_scale", td.sigmoid_scale, "a positive number"),
        (min(cfg.model.tiny_vae_fit.frame_steps, cfg.model.tiny_vae_fit.clip_steps) >= 0
         and cfg.model.tiny_vae_fit.videos >= 1, "model.tiny_vae_fit", dict(cfg.model.tiny_vae_fit),
         "steps >= 0 and videos >= 1"),
        (0 <= cfg.model.tiny_vae_fit.min_colour_shown <= 1 and cfg.model.tiny_vae_fit.max_rounds >= 1,
         "model.tiny_vae_fit.min_colour_shown/max_rounds",
         [cfg.model.tiny_vae_fit.min_colour_shown, cfg.model.tiny_vae_fit.max_rounds],
         "a share in [0, 1] and at least 1 round"),
        (min(cfg.model.loss_weights.values()) >= 0 and sum(cfg.model.loss_weights.values()) > 0,
         "model.loss_weights", dict(cfg.model.loss_weights), "weights >= 0, not all zero"),
        (0 <= cfg.dataset.val_fraction < 1, "dataset.val_fraction", cfg.dataset.val_fraction, "a number in [0, 1)"),
        (cfg.system.total_limit is None or cfg.system.total_limit >= 1, "system.total_limit",
         cfg.system.total_limit, "null (keep all) or a positive integer"),
        (cfg.system.num_workers >= 0, "system.num_workers", cfg.system.num_workers, "an integer >= 0"),
        (cfg.system.hang_timeout_minutes is None or cfg.system.hang_timeout_minutes > 0, "system.hang_timeout_minutes",
         cfg.system.hang_timeout_minutes, "null (never) or a positive number of minutes"),
        (cfg.serving.batch_window_ms >= 0, "serving.batch_window_ms", cfg.serving.batch_window_ms, "a number >= 0"),
    ]
    for ok, key, value, expected in rules:
        require(source, ok, key, value, expected)
    _check_speed(cfg, source)
    d = cfg.dataset
    dirs = [d.dataset_dir] if isinstance(d.dataset_dir, str) else list(d.dataset_dir)
    require(source, bool(dirs), "dataset.dataset_dir", dirs, "a folder or a non-empty list of folders")
    if d.weights is not None:
        require(source, len(d.weights) == len(dirs) and min(d.weights) >= 0 and sum(d.weights) > 0,
                "dataset.weights", list(d.weights),
                f"one non-negative number per dataset_dir entry ({len(dirs)} in all) with a positive sum")
    if d.relative_action_dims:
        rel, joint_dims = list(d.relative_action_dims), min(cfg.common.action_dim, cfg.common.state_dim)
        require(source, cfg.model.mode == "finetune", "dataset.relative_action_dims", rel,
                "null with model.mode pretrain (the model reads no state to measure the actions from)")
        require(source, len(set(rel)) == len(rel) and all(0 <= i < joint_dims for i in rel),
                "dataset.relative_action_dims", rel,
                f"distinct indices in [0, {joint_dims}) (common.action_dim and common.state_dim)")
    if d.relative_action_horizon is not None:
        require(source, bool(d.relative_action_dims), "dataset.relative_action_horizon", d.relative_action_horizon,
                "null without dataset.relative_action_dims (it fades their distance from the state)")
        require(source, isinstance(d.relative_action_horizon, int) and d.relative_action_horizon >= 1,
                "dataset.relative_action_horizon", d.relative_action_horizon, "a positive number of actions or null")
    if d.type == "robotwin" and d.task_mode == "single" and not d.task_name:
        raise ConfigError(f"{source}: 'dataset.task_mode' is single but 'dataset.task_name' is not set")
    _check_serving(cfg.serving, source)
    _check_evaluation(cfg, source)
    if d.frame_layout == "robotwin":  # the server composes head, left wrist, right wrist as training did
        require(source, len(cfg.serving.image_keys) == 3, "serving.image_keys", list(cfg.serving.image_keys),
                "3 observation keys (head, left wrist, right wrist cameras) with dataset.frame_layout robotwin")


def _check_evaluation(cfg: DictConfig, source: str) -> None:
    """An evaluation the trainer would start after minutes of training must be able to run: its task's
    simulator installed, the checkpoint's actions, state and camera what the task takes, its seeds
    evaluation seeds (TRAINING.md, "Closed-loop evaluation during training")."""
    ev = cfg.evaluation
    if ev.task is None:
        return
    try:
        task = installed_task(ev.task)
    except SimTaskError as e:
        raise ConfigError(f"{source}: 'evaluation.task' is {ev.task!r}: {e}") from None
    the_task = f"evaluation.task {task.name} ({task.gym_id})"
    first = EVAL_SEEDS.start if ev.seed is None else ev.seed
    chunk = cfg.common.num_video_frames * cfg.common.video_action_freq_ratio
    save = cfg.system.save_interval
    rules = [
        (ev.interval > 0 and ev.interval % save == 0, "evaluation.interval", ev.interval,
         f"a positive multiple of system.save_interval ({save}): an evaluation runs on a saved checkpoint"),
        (first in EVAL_SEEDS and first + ev.episodes - 1 in EVAL_SEEDS, "evaluation.seed", ev.seed,
         f"null or a seed such that seed .. seed + episodes - 1 ({ev.episodes} episodes) lie in the evaluation "
         f"seeds [{EVAL_SEEDS.start}, {EVAL_SEEDS.stop}) (data.sim_env.EVAL_SEEDS; never a demonstration seed)"),
        (ev.videos >= 0, "evaluation.videos", ev.videos, "an integer >= 0"),
        (ev.replan is None or 1 <= ev.replan <= chunk, "evaluation.replan", ev.replan,
         f"null (the whole chunk) or 1 .. common.action_chunk_size ({chunk})"),
        (ev.episode_steps is None or 1 <= ev.episode_steps <= task.max_steps, "evaluation.episode_steps",
         ev.episode_steps, f"null (the task's cap) or 1 .. {task.max_steps}, the cap of {the_task}"),
        (re.fullmatch(r"cpu|cuda(:\d+)?", ev.device) is not None, "evaluation.device", ev.device,
         "cpu, cuda or cuda:N"),
        (cfg.common.action_dim == task.action_dim, "common.action_dim", cfg.common.action_dim,
         f"{task.action_dim}: {the_task} takes {task.action_dim}-D actions"),
        (cfg.model.mode == "pretrain" or cfg.common.state_dim == task.state_dim, "common.state_dim",
         cfg.common.state_dim, f"{task.state_dim}: {the_task} gives a {task.state_dim}-D state, which the policy "
         "is served in model.mode finetune"),
        (len(cfg.serving.image_keys) == 1, "serving.image_keys", list(cfg.serving.image_keys),
         f"one key: {the_task} gives one camera ({task.image_key})"),
    ]
    for ok, key, value, expected in rules:
        require(source, ok, key, value, expected)


def _check_serving(sv: DictConfig, source: str) -> None:
    keys = list(sv.image_keys) + [sv.state_key, sv.prompt_key]
    require(source, len(sv.image_keys) > 0, "serving.image_keys", list(sv.image_keys),
            "at least one observation key (one per recipe camera)")
    require(source, len(set(keys)) == len(keys) and all(keys), "serving.image_keys/state_key/prompt_key", keys,
            "distinct, non-empty observation keys")
    if sv.image_shape is not None:
        shape = list(sv.image_shape)
        require(source, len(shape) == 3 and shape[2] == 3 and min(shape) > 0, "serving.image_shape", shape,
                "null or [H, W, 3] with positive H and W")


def load_config(path: str, overrides: Iterable[str] = (), saved: bool = False) -> DictConfig:
    """Load `path` (YAML), apply `key=value` overrides, check every rule, derive; read-only result.
    saved: `path` is a config.yaml written by save_config (a run's or a checkpoint's): its derived
    fields are recomputed instead of refused."""
    cfg = load_structured(Config, path, overrides)
    if saved:
        for key in DERIVED:
            OmegaConf.update(cfg, key, None)
    _check_values(cfg, path)
    cfg.common.action_chunk_size = cfg.common.num_video_frames * cfg.common.video_action_freq_ratio
    OmegaConf.set_readonly(cfg, True)
    return cfg


def save_config(cfg: DictConfig, path: str) -> None:
    """Write the resolved config (derived fields included) as YAML."""
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(cfg))


def config_stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]
