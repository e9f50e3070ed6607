"""The rules on a recipe that depend on how a run is launched: the process count, --deepspeed (its ZeRO
JSON against the YAML) and the machine (CUDA). Every other rule runs when the recipe is loaded
(recipe/config.py)."""
import json
import os
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from utils.config import ConfigError


def check_launch(cfg: DictConfig, world_size: int, deepspeed: Optional[str]) -> Optional[dict[str, Any]]:
    """The rules that depend on how the run is launched: the process count and --deepspeed (the path of
    its ZeRO JSON, None for DDP). Returns the DeepSpeed config with its "auto" fields filled, or None."""
    t = cfg.training
    per_step = t.batch_size * t.gradient_accumulation_steps * world_size
    if t.global_batch_size is not None and t.global_batch_size != per_step:
        raise ConfigError(
            f"training.global_batch_size={t.global_batch_size} does not divide into batch_size "
            f"{t.batch_size} x gradient_accumulation_steps {t.gradient_accumulation_steps} x {world_size} "
            f"processes = {per_step}; change gradient_accumulation_steps to "
            f"{t.global_batch_size / (t.batch_size * world_size):g} or the process count")
    sp = cfg.system.speed
    ddp_only = [k for k, on in (("bucket_cap_mb", sp.bucket_cap_mb is not None), ("static_graph", sp.static_graph)) if on]
    if ddp_only and deepspeed:
        raise ConfigError(f"system.speed.{ddp_only[0]} applies to DDP only, and this run uses --deepspeed; "
                          "set it back to its default (bucket_cap_mb null, static_graph false) and size "
                          "DeepSpeed's buckets with reduce_bucket_size / allgather_bucket_size in the ZeRO JSON")
    if sp.cuda_graphs and not torch.cuda.is_available():
        raise ConfigError("system.speed.cuda_graphs=true needs CUDA, and this machine has none; set it to false")
    if cfg.model.precision == "bf16_mixed" and not deepspeed:
        raise ConfigError("model.precision=bf16_mixed needs --deepspeed (its fp32 master weights); "
                          "use fp32_mixed without DeepSpeed")
    return load_deepspeed_config(deepspeed, cfg, world_size) if deepspeed else None


def load_deepspeed_config(path: str, cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """Read a ZeRO JSON and fill its "auto" fields from the config; reject contradictions (ValueError,
    naming the file, the key and the YAML key that decides it)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed config '{path}' does not exist (try configs/zero1.json "
                                "or configs/zero2.json, or leave --deepspeed out to train with DDP)")
    try:
        with open(path) as f:
            ds = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config '{path}' is not valid JSON: {e}") from None
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(f"{path}: remove the '{key}' section: the optimizer and lr schedule come from "
                             "the YAML (training.optimizer, training.scheduler_type); a DeepSpeed optimizer "
                             "would replace MuonAdamW")
    t = cfg.training
    # DeepSpeed field -> (the YAML's value, where it comes from); the JSON says "auto" or agrees
    owned = {
        "train_micro_batch_size_per_gpu": (t.batch_size, "training.batch_size"),
        "gradient_accumulation_steps": (t.gradient_accumulation_steps, "training.gradient_accumulation_steps"),
        "gradient_clipping": (float(t.grad_clip_norm), "training.grad_clip_norm"),
        "train_batch_size": (t.batch_size * t.gradient_accumulation_steps * world_size,
                             "training.batch_size * gradient_accumulation_steps * world size"),
    }
    for key, (value, source) in owned.items():
        given = ds.get(key, "auto")
        if given != "auto" and float(given) != float(value):
            raise ValueError(f"{path}: '{key}' is {given} but the YAML gives {value} ({source}); "
                             f"set it to \"auto\" so the YAML decides")
        ds[key] = value
    bf16 = cfg.model.precision == "bf16_mixed"
    given = ds.get("bf16", {}).get("enabled", "auto")
    if given != "auto" and bool(given) != bf16:
        raise ValueError(f"{path}: 'bf16.enabled' is {given} but model.precision is "
                         f"{cfg.model.precision}; set it to \"auto\"")
    ds["bf16"] = {**ds.get("bf16", {}), "enabled": bf16}
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ValueError(f"{path}: zero_optimization.stage is {stage}; this recipe supports ZeRO 0, 1 and 2")
    # The non-finite step guard (train/deepspeed_engine.py) relies on DeepSpeed skipping an update whose
    # global gradient norm is not finite: these two switches turn that off.
    for section, key in (("bf16", "check_grad_overflow"), ("zero_optimization", "compute_grad_norm")):
        if ds.get(section, {}).get(key, True) is False:
            raise ValueError(f"{path}: '{section}.{key}' is false; remove it: a step with a non-finite loss "
                             "or gradient must be skipped, which needs DeepSpeed's gradient check")
    if cfg.training.ema.enabled and stage == 0 and bf16:  # DeepSpeed's bf16 optimizer hides its fp32 masters
        raise ValueError(f"{path}: training.ema needs ZeRO stage 1 or 2 under model.precision=bf16_mixed "
                         "(stage 0 keeps no fp32 weights the EMA can follow); use configs/zero1.json or zero2.json")
    ds.setdefault("steps_per_print", 10**9)  # our own metrics log; keep DeepSpeed quiet
    return ds
