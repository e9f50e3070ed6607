"""`build_optimizer`: the optimizer named by `training.optimizer`, with its split logged once."""
import dataclasses
import logging
from typing import Any, Iterable

import torch
import torch.distributed as tdist
from omegaconf import DictConfig, OmegaConf

from optim.adamw import kernel_args, keep_kernel
from optim.config import OPTIMIZERS, MuonConfig
from optim.muon_adamw import MuonAdamW

logger = logging.getLogger(__name__)

# MuonConfig field -> MuonAdamW argument, where the argument needs the "muon_" prefix to be clear
_ARGUMENT = {"momentum": "muon_momentum", "include": "muon_include", "exclude": "muon_exclude"}


def muon_arguments(muon_cfg: DictConfig | MuonConfig) -> dict[str, Any]:
    """MuonAdamW's Muon arguments from a `training.muon` section (DictConfig or MuonConfig)."""
    def plain(value: Any) -> Any:  # lists arrive as OmegaConf ListConfig from a DictConfig
        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value

    return {_ARGUMENT.get(f.name, f.name): plain(getattr(muon_cfg, f.name)) for f in dataclasses.fields(MuonConfig)}


def build_optimizer(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], training_cfg: DictConfig, world_size: int,
                    fused_adamw: bool = False) -> torch.optim.Optimizer:
    """MuonAdamW or torch.optim.AdamW from `cfg.training`; groups carry "name" and "initial_lr".

    `fused_adamw`: AdamW (all of it, or MuonAdamW's AdamW group) on torch's fused kernel (optim/adamw.py)."""
    t = training_cfg
    named = list(named_parameters)
    if t.optimizer == "adamw":
        seen, params = set(), []
        for _, p in named:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        optimizer = keep_kernel(torch.optim.AdamW(
            [dict(params=params, name="adamw", initial_lr=t.learning_rate)], lr=t.learning_rate,
            betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay, **kernel_args(fused_adamw)), fused_adamw)
        lines = [f"adamw: {len(params)} tensors, {sum(p.numel() for p in params):,} parameters, "
                 f"lr {t.learning_rate:.3g}"]
    elif t.optimizer == "muon_adamw":
        optimizer = MuonAdamW(named, lr=t.learning_rate, weight_decay=t.weight_decay, betas=tuple(t.betas), eps=t.eps,
                              world_size=world_size, fused_adamw=fused_adamw, **muon_arguments(t.muon))
        lines = optimizer.split_summary()
    else:
        raise ValueError(f"training.optimizer is {t.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    if not tdist.is_initialized() or tdist.get_rank() == 0:
        kernel = "fused" if fused_adamw else "torch default"
        logger.info("optimizer %s (AdamW kernel: %s), parameter split:\n  %s", t.optimizer, kernel, "\n  ".join(lines))
    return optimizer
