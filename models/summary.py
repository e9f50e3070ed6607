"""`python -m models.summary <config.yaml> [--gpus N] [key=value ...]`: parameter counts and the
per-GPU memory of weights, gradients and optimizer state (with the EMA of the weights when
`training.ema.enabled`) under ZeRO stages 0, 1 and 2.

Everything is built on the `meta` device from the size table: no weights are read or
allocated, so the full-size model is summarised in seconds. Activations are not counted.
"""
import argparse
import json
import logging

import torch

from models.build import model_spec
from models.serialization import count_parameters
from models.sizes import get_size

GIB = 1024 ** 3
# bytes per trainable parameter: (weights, gradients, optimizer state). Mixed bf16 keeps bf16
# weights and gradients plus an fp32 master copy and Adam's two moments (the ZeRO paper's 2+2+12);
# fp32 and fp32_mixed keep fp32 weights and gradients and the two moments.
BYTES = {"bf16_mixed": (2, 2, 12), "fp32_mixed": (4, 4, 8), "fp32": (4, 4, 8)}
EMA_BYTES = 4  # the fp32 EMA (train/ema.py), partitioned like the fp32 masters from ZeRO-1 on


def count_components(cfg):
    """Parameter counts of every part, built on meta from the size table."""
    from diffusers import AutoencoderKLWan
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, UMT5Config, UMT5EncoderModel

    from models.world_model import WorldModel

    size = get_size(cfg.model.size)
    with torch.device("meta"):
        model = WorldModel(model_spec(cfg, size, size.wan, size.vae, cfg.model.und_expert.vlm.input_dim))
        vlm = Qwen3VLForConditionalGeneration(
            Qwen3VLConfig(text_config=size.vlm_text, vision_config=size.vlm_vision, **size.vlm_extra))
        vae = AutoencoderKLWan(**size.vae)
        text_encoder = UMT5EncoderModel(UMT5Config(**size.text_encoder))
    return {"video": count_parameters(model.video), "action_expert": count_parameters(model.action_expert),
            "und_expert": count_parameters(model.und_expert), "vlm": count_parameters(vlm),
            "vae": count_parameters(vae), "text_encoder": count_parameters(text_encoder)}


def memory_estimate(trainable, frozen, precision, gpus, ema=False):
    """GiB per GPU for ZeRO stages 0, 1, 2 (stage 1 shards optimizer state and the EMA, stage 2 also
    gradients)."""
    w, g, o = BYTES[precision]
    frozen_bytes = 4 if precision == "fp32" else 2
    out = {}
    for stage in (0, 1, 2):
        parts = {"weights": trainable * w, "gradients": trainable * g / (gpus if stage >= 2 else 1),
                 "optimizer_state": trainable * o / (gpus if stage >= 1 else 1),
                 "frozen_weights": frozen * frozen_bytes}
        if ema:
            parts["ema"] = trainable * EMA_BYTES / (gpus if stage >= 1 else 1)
        parts = {k: round(v / GIB, 2) for k, v in parts.items()}
        parts["total"] = round(sum(parts.values()), 2)
        out[f"zero{stage}"] = parts
    return out


def summarize(cfg, gpus):
    counts = count_components(cfg)
    trainable = counts["video"] + counts["action_expert"] + counts["und_expert"]
    frozen = counts["vlm"] + counts["vae"] + counts["text_encoder"]
    return {
        "size": cfg.model.size, "mode": cfg.model.mode, "precision": cfg.model.precision, "gpus": gpus,
        "parameters": counts,
        "trainable": trainable,
        "total_video_vlm_experts": trainable + counts["vlm"],
        "memory_gib_per_gpu": memory_estimate(trainable, frozen, cfg.model.precision, gpus,
                                              cfg.training.ema.enabled),
        "assumes": "AdamW state (Muon matrices keep one buffer instead of two, so less); "
                   "frozen parts replicated on every GPU; activations not included",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args()
    if args.gpus < 1:
        parser.error(f"--gpus is {args.gpus}; expected a positive integer")
    logging.disable(logging.WARNING)  # one JSON object on stdout, nothing else
    from train.config import load_config

    print(json.dumps(summarize(load_config(args.config, args.overrides), args.gpus), indent=2))


if __name__ == "__main__":
    main()
