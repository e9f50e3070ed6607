"""How a run's processes and engine are set up: accelerate starts the process group (gloo on CPU, NCCL on
GPU) and wraps the model; `make_engine` picks the engine the launch asks for (--deepspeed or DDP)."""
import os
from datetime import timedelta
from typing import Any, Optional

import torch

from train.ddp_engine import DDPEngine
from train.deepspeed_engine import DeepSpeedEngine
from train.engine import Engine
from utils import dist


def _single_process_env() -> None:
    """`python train/train.py` without a launcher is a world of one: give it a rendezvous."""
    if "WORLD_SIZE" in os.environ:
        return
    os.environ.update(dist.single_process_env())


def make_accelerator(ds_config: Optional[dict[str, Any]], timeout_minutes: float, speed: Any = None) -> Any:
    """`ds_config`: the DeepSpeed config train/launch_checks.py `check_launch` returned, None for DDP.
    `speed`: the `system.speed` section, whose bucket_cap_mb and static_graph configure DDP
    (accelerate uses them without DeepSpeed only); None: DDP's defaults."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs

    from train.speed import ddp_kwargs

    _single_process_env()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # cpu=True would silently drop DeepSpeed; the backend choice is what makes CPU work. Without
    # DeepSpeed on CPU it is what makes accelerate wrap the model in DDP (else every rank trains alone).
    return Accelerator(
        cpu=not ds_config and not torch.cuda.is_available(),
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config) if ds_config else None,
        kwargs_handlers=[InitProcessGroupKwargs(backend=backend, timeout=timedelta(minutes=timeout_minutes)),
                         *([] if speed is None else [ddp_kwargs(speed)])],
    )


def make_engine(accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Any) -> Engine:
    """The DeepSpeed engine when the accelerator carries a DeepSpeed config, else DDP."""
    kind = DeepSpeedEngine if accelerator.state.deepspeed_plugin is not None else DDPEngine
    return kind(accelerator, model, optimizer, cfg)
