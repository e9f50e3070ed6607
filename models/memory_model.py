"""`python -m models.memory_model <config.yaml> [--gpus N] [--gpu-memory GIB] [--measure] [key=value ...]`:
parameter counts, the per-GPU memory of a training step under ZeRO stages 0, 1 and 2, and the
largest `training.batch_size` that fits a GPU of `--gpu-memory` GiB. With `training.ema.enabled` the
static part includes the fp32 EMA of the weights (4 bytes per trainable parameter / W from ZeRO-1 on).

Everything is built on fake tensors from the size table: no weights are read or allocated, so
the full-size model is summarised in about a minute on a CPU. Per GPU and ZeRO stage:

    static      = trainable x (weights + gradients/W2 + optimizer state/W1) + frozen parts held on the GPU
                  + the umT5 text-embedding cache's bound when the text encoder is one of them
    activations = batch x (kept + working set)     (models/activation_memory.py, traced at the real shapes)
    peak        = static + ZeRO buckets + max(activations, fp32 gradient partition at the optimizer step)
    fits        = peak <= FRAGMENTATION x gpu_memory - RESERVED_GIB

`--measure` also runs one real forward on the CPU and prints the traced and measured bytes side by side
(the calibration of the activation term; slow for the motus size).

`host_ram_gib_per_process`: the host memory the frozen parts take in every training process
(parameters x 2 bytes, 4 with model.precision fp32), for the parts this run builds and for a run
without and with a latent cache (which builds the VAE only: models/build.py). Multiply by the GPUs
per node to size the node's RAM.
"""
import argparse
import json
import logging
from collections.abc import Container, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensorMode

from models import activation_memory
from models.build import (CACHED_INPUTS, FROZEN_OUTPUTS, frozen_parts_for_training, frozen_parts_needed,
                          provided_inputs, size_table_model)
from models.serialization import count_parameters
from models.sizes import ModelSize, get_size
from models.world_model import WorldModel

GIB = 1024 ** 3
# bytes per trainable parameter: (weights, gradients, optimizer state). Mixed bf16 keeps bf16
# weights and gradients plus an fp32 master copy and Adam's two moments (the ZeRO paper's 2+2+12);
# fp32 and fp32_mixed keep fp32 weights and gradients and the two moments. A Muon matrix keeps one
# momentum instead of two moments: 4 bytes less.
BYTES = {"bf16_mixed": (2, 2, 12), "fp32_mixed": (4, 4, 8), "fp32": (4, 4, 8)}
MUON_SAVING = 4
EMA_BYTES = 4  # the fp32 EMA of the weights (train/ema.py), partitioned like the fp32 masters from ZeRO-1 on
# ZeRO-2's gradient buckets (configs/zero2.json: reduce_bucket_size 5e7 elements, bf16, ipg buffer
# and the bucket being reduced).
BUCKET_BYTES = 2 * 50_000_000 * 2
# Not in torch.cuda.max_memory_allocated but on the GPU: the CUDA context, NCCL's buffers and the
# allocator's fragmentation. What is left for the step: FRAGMENTATION x memory - RESERVED_GIB.
RESERVED_GIB, FRAGMENTATION = 2.0, 0.9
# The backward's working set beyond the kept tensors, in saved bytes of one layer: the gradients of
# one layer's activations (1), plus, with checkpointing, that layer's recomputed activations (2).
WORKING_LAYERS = {False: 1, True: 2}


def count_components(cfg: DictConfig) -> tuple[dict[str, int], WorldModel, ModelSize]:
    """Parameter counts of every part, and the WorldModel and size entry, built on fake tensors."""
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, UMT5Config, UMT5EncoderModel

    size = get_size(cfg.model.size)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = size_table_model(cfg)
        vlm = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(text_config=size.vlm_text, vision_config=size.vlm_vision, **size.vlm_extra))
        vae = AutoencoderKLWan(**size.vae)
        text_encoder = UMT5EncoderModel(UMT5Config(**size.text_encoder))
    counts = {"video": count_parameters(model.video), "action_expert": count_parameters(model.action_expert),
              "und_expert": count_parameters(model.und_expert), "vlm": count_parameters(vlm),
              "vae": count_parameters(vae), "text_encoder": count_parameters(text_encoder)}
    return counts, model, size


def muon_parameters(cfg: DictConfig, model: WorldModel) -> int:
    """Parameters that MuonAdamW trains with Muon (0 with AdamW)."""
    if cfg.training.optimizer != "muon_adamw":
        return 0
    from optim.routing import split_params

    m = cfg.training.muon
    muon, _ = split_params(model.named_parameters(), m.routing, m.include, m.exclude)
    return sum(p.numel() for _, p in muon)


def frozen_parts_on_gpu(cfg: DictConfig) -> list[str]:
    """The frozen parts a training step needs on the GPU: those whose outputs the data does not provide."""
    provided = provided_inputs(cfg)
    return [k for k, produced in FROZEN_OUTPUTS.items() if produced not in provided]


def frozen_bytes(precision: str) -> int:
    """Bytes per frozen parameter: the parts are loaded in their compute dtype (models/build.py)."""
    return 4 if precision == "fp32" else 2


def host_ram(cfg: DictConfig, counts: Mapping[str, int]) -> dict[str, list[str] | float]:
    """GiB of host memory per process that the frozen parts take: this run's, and without / with a
    latent cache (models/build.py builds only what the run calls)."""
    def gib_of(parts: Iterable[str]) -> float:
        return gib(sum(counts[k] for k in parts) * frozen_bytes(cfg.model.precision))

    built = frozen_parts_for_training(cfg)
    return {"frozen_parts_built": list(built), "this_run": gib_of(built),
            "without_cache": gib_of(frozen_parts_needed(set())),
            "with_cache": gib_of(frozen_parts_needed(CACHED_INPUTS))}


def text_cache_bytes(cfg: DictConfig, frozen_on_gpu: Container[str]) -> int:
    """The umT5 embedding cache's bound (model.wan.text_cache_mb) where the text encoder runs on the GPU:
    raw data fills it with one entry per instruction seen (models/encoders.py)."""
    return int(cfg.model.wan.text_cache_mb * 2 ** 20) if "text_encoder" in frozen_on_gpu else 0


def static_memory(counts: Mapping[str, int], trainable: int, muon: int, frozen_on_gpu: Iterable[str], precision: str,
                  gpus: int, ema: bool = False, text_cache: int = 0) -> dict[str, dict[str, float]]:
    """Bytes per GPU, independent of the batch, for ZeRO stages 0, 1, 2 (with the EMA when `ema`;
    `text_cache`: the text-embedding cache's bytes, `text_cache_bytes`)."""
    w, g, o = BYTES[precision]
    out = {}
    for stage in (0, 1, 2):
        out[f"zero{stage}"] = {
            "weights": trainable * w, "gradients": trainable * g / (gpus if stage >= 2 else 1),
            "optimizer_state": (trainable * o - muon * MUON_SAVING) / (gpus if stage >= 1 else 1),
            "frozen_weights": sum(counts[k] for k in frozen_on_gpu) * frozen_bytes(precision),
            "text_cache": text_cache}
        if ema:
            out[f"zero{stage}"]["ema"] = EMA_BYTES * trainable / (gpus if stage >= 1 else 1)
    return out


def activation_bytes(cfg: DictConfig, size: ModelSize) -> dict[bool, dict[str, int]]:
    """Per-sample activation bytes, {checkpointing: {kept, working_set}} (models/activation_memory.py)."""
    return {c: {"kept": a.kept, "working_set": WORKING_LAYERS[c] * a.per_layer}
            for c, a in activation_memory.per_sample(cfg, size).items()}


# Bytes per parameter of a param group alive during its optimizer step (step_transient).
STEP_GROUP_BYTES = {"adamw": 2 + 4, "muon": 4 + 4 + 2}


def step_transient(trainable: int, precision: str, gpus: int, stage: int, muon: int = 0) -> float:
    """Bytes per GPU alive at the optimizer step only, when the activations are already freed.
    DeepSpeed's bf16 ZeRO step runs one param group at a time: the group's bf16 gradient partition is
    flattened (a 2-byte copy) into fp32 (4 bytes) for the update; MuonAdamW's Muon group (`muon`
    parameters) then also holds its Nesterov update (fp32, 4) and every orthogonalised matrix (bf16,
    2) until it applies them (optim/partitioned.owner_step). benchmarks/step_memory_cpu.py measures it."""
    if precision != "bf16_mixed":
        return 0
    return max(STEP_GROUP_BYTES["adamw"] * (trainable - muon), STEP_GROUP_BYTES["muon"] * muon) / (
        gpus if stage >= 1 else 1)


def peak(static_bytes: float, per_sample: float, batch: int, transient: float) -> float:
    return static_bytes + BUCKET_BYTES + max(batch * per_sample, transient)


def largest_batch(static_bytes: float, per_sample: float, transient: float, budget: float) -> int:
    if peak(static_bytes, per_sample, 0, transient) > budget:
        return 0
    return int((budget - static_bytes - BUCKET_BYTES) // per_sample)


def budget(cfg: DictConfig, counts: Mapping[str, int], model: WorldModel, size: ModelSize, gpus: int,
           gpu_memory: float) -> dict[str, Any]:
    """The whole per-GPU budget: static parts, activations per sample, peak at the config's batch and
    the largest batch that fits, for every ZeRO stage and both checkpointing settings."""
    trainable = counts["video"] + counts["action_expert"] + counts["und_expert"]
    frozen_on_gpu = frozen_parts_on_gpu(cfg)
    muon = muon_parameters(cfg, model)
    static = static_memory(counts, trainable, muon, frozen_on_gpu, cfg.model.precision, gpus, cfg.training.ema.enabled,
                           text_cache_bytes(cfg, frozen_on_gpu))
    acts = activation_bytes(cfg, size)
    usable = FRAGMENTATION * gpu_memory * GIB - RESERVED_GIB * GIB
    batch = cfg.training.batch_size
    out = {"frozen_on_gpu": frozen_on_gpu, "usable_gib": gib(usable),
           "activations_gib_per_sample": {("checkpointing" if c else "no_checkpointing"): {k: gib(v) for k, v in a.items()}
                                          for c, a in acts.items()}}
    for stage, parts in static.items():
        total = sum(parts.values())
        transient = step_transient(trainable, cfg.model.precision, gpus, int(stage[-1]), muon)
        row = {k: gib(v) for k, v in parts.items()}
        row.update(static_total=gib(total), step_transient=gib(transient))
        for c, a in acts.items():
            name = "checkpointing" if c else "no_checkpointing"
            per_sample = a["kept"] + a["working_set"]
            row[f"peak_at_batch_{batch}_{name}"] = gib(peak(total, per_sample, batch, transient))
            row[f"largest_batch_{name}"] = largest_batch(total, per_sample, transient, usable)
        out[stage] = row
    return out


def gib(n: float) -> float:
    return round(n / GIB, 2)


def zero2_prediction(cfg: DictConfig, gpus: int = 1) -> tuple[float, dict[bool, int], float, dict[str, int]]:
    """The ZeRO-2 memory model's parts per GPU, unrounded: (static bytes, bytes per sample
    {checkpointing: kept + working set}, the optimizer step's transient bytes, parameter counts)."""
    counts, model, size = count_components(cfg)
    trainable = counts["video"] + counts["action_expert"] + counts["und_expert"]
    muon = muon_parameters(cfg, model)
    frozen_on_gpu = frozen_parts_on_gpu(cfg)
    static = sum(static_memory(counts, trainable, muon, frozen_on_gpu, cfg.model.precision, gpus,
                               cfg.training.ema.enabled, text_cache_bytes(cfg, frozen_on_gpu))["zero2"].values())
    per_sample = {c: a["kept"] + a["working_set"] for c, a in activation_bytes(cfg, size).items()}
    return static, per_sample, step_transient(trainable, cfg.model.precision, gpus, 2, muon), counts


def predict_peak(cfg: DictConfig, batch: int, checkpointing: bool, gpus: int = 1) -> float:
    """Predicted torch.cuda.max_memory_allocated of one training step (ZeRO-2), in GiB: what the GPU
    check prints beside each measured figure."""
    static, per_sample, transient, _ = zero2_prediction(cfg, gpus)
    return gib(peak(static, per_sample[checkpointing], batch, transient))


def summarize(cfg: DictConfig, gpus: int, gpu_memory: float = 80.0) -> dict[str, Any]:
    counts, model, size = count_components(cfg)
    trainable = counts["video"] + counts["action_expert"] + counts["und_expert"]
    return {
        "size": cfg.model.size, "mode": cfg.model.mode, "precision": cfg.model.precision, "gpus": gpus,
        "gpu_memory_gib": gpu_memory, "optimizer": cfg.training.optimizer, "batch_size": cfg.training.batch_size,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "parameters": counts,
        "trainable": trainable,
        "total_video_vlm_experts": trainable + counts["vlm"],
        "memory_gib_per_gpu": budget(cfg, counts, model, size, gpus, gpu_memory),
        "host_ram_gib_per_process": host_ram(cfg, counts),
        "assumes": f"frozen parts on the GPU only where the data does not provide their outputs "
                   f"(dataset.cache_dir provides all three); activations traced at the real shapes with a fused "
                   f"attention kernel; usable = {FRAGMENTATION} x GPU memory - {RESERVED_GIB} GiB (CUDA context, "
                   f"NCCL, fragmentation); ZeRO-2 buckets {gib(BUCKET_BYTES)} GiB",
    }


def calibration(cfg: DictConfig, num_layers: int | None = None) -> dict[str, dict[str, float]]:
    """Traced (fake tensors, extrapolated from 2 and 3 layers) vs measured (one real CPU forward at
    batch 1, random init) activation bytes, for both checkpointing settings."""
    size = get_size(cfg.model.size)
    depth = num_layers or size.num_layers
    size = replace(size, wan=dict(size.wan, num_layers=depth))
    traced = activation_memory.per_sample(cfg, size)
    torch.manual_seed(0)
    real = size_table_model(cfg, depth)
    measured = activation_memory.measure(real, activation_memory.example_inputs(cfg, real, size, 1))
    return {("checkpointing" if c else "no_checkpointing"): {
        "traced_bytes": traced[c].kept, "measured_bytes": measured[c].kept,
        "ratio": round(traced[c].kept / measured[c].kept, 4), "num_layers": depth} for c in (False, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (80 for an A100/H100 80GB)")
    parser.add_argument("--measure", action="store_true", help="also measure the activations on the CPU")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args()
    if args.gpus < 1:
        parser.error(f"--gpus is {args.gpus}; expected a positive integer")
    if args.gpu_memory <= 0:
        parser.error(f"--gpu-memory is {args.gpu_memory}; expected GiB per GPU, e.g. 80")
    logging.disable(logging.WARNING)  # one JSON object on stdout, nothing else
    from recipe.config import load_config

    cfg = load_config(args.config, args.overrides)
    report = summarize(cfg, args.gpus, args.gpu_memory)
    if args.measure:
        report["activation_calibration"] = calibration(cfg)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
