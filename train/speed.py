"""Apply the `system.speed` switches: the backend flags once at start, regional compilation of
the model, and DDP's options. TRAINING.md ("Speed switches") says what each one does and costs.

`fused_adamw` goes to `optim.build_optimizer` (train/train.py's build_everything).
"""
import logging
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig

if TYPE_CHECKING:
    from accelerate.utils import DistributedDataParallelKwargs

    from models.encoders import FrozenEncoders
    from models.world_model import WorldModel

log = logging.getLogger(__name__)


def matmul_precision(speed: DictConfig) -> str:
    """The float32 matmul precision the switches ask for (null follows tf32)."""
    if speed.matmul_precision is not None:
        return speed.matmul_precision
    return "high" if speed.tf32 else "highest"


def set_backend_flags(speed: DictConfig) -> dict[str, str | bool]:
    """Set the process-wide matmul/cuDNN flags once, before the model runs; return what was set.
    They only change what runs on a GPU; on the CPU they are set but have no effect."""
    torch.set_float32_matmul_precision(matmul_precision(speed))
    torch.backends.cudnn.allow_tf32 = bool(speed.tf32)
    torch.backends.cudnn.benchmark = bool(speed.cudnn_benchmark)
    return {"matmul_precision": torch.get_float32_matmul_precision(),
            "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn.benchmark": torch.backends.cudnn.benchmark}


def compile_mode(speed: DictConfig) -> str | None:
    """torch.compile's mode for the layer: reduce-overhead captures it in CUDA graphs."""
    return "reduce-overhead" if speed.cuda_graphs else None


def apply(model: "WorldModel", encoders: "FrozenEncoders", speed: DictConfig) -> "WorldModel":
    """Backend flags and regional compilation of `model` (a WorldModel) and of the frozen VAE's
    encoder (`encoders`, FrozenEncoders), logged once. Call it before the engine wraps the model,
    on every rank."""
    flags = set_backend_flags(speed)
    if speed.compile:
        model.compile_blocks(compile_mode(speed))
        encoders.compile_video_encoder()  # CUDA graphs stay in the layer: the VAE mutates its cache
    # one graph per understanding-token length: bucket the lengths a raw batch's prompts give
    encoders.vlm_len_multiple = speed.cuda_graphs_token_multiple if speed.cuda_graphs else 1
    log.info("speed switches: compile %s (mode %s), fused_adamw %s, cuda_graphs %s; backend flags %s",
             speed.compile, compile_mode(speed) or "default", speed.fused_adamw, speed.cuda_graphs,
             ", ".join(f"{k}={v}" for k, v in flags.items()))
    return model


def ddp_kwargs(speed: DictConfig) -> "DistributedDataParallelKwargs":
    """accelerate's DistributedDataParallelKwargs from bucket_cap_mb and static_graph (used
    without DeepSpeed only; check_launch refuses them with --deepspeed)."""
    from accelerate.utils import DistributedDataParallelKwargs

    kwargs: dict[str, bool | int] = {"static_graph": bool(speed.static_graph)}
    if speed.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = int(speed.bucket_cap_mb)
    return DistributedDataParallelKwargs(**kwargs)
