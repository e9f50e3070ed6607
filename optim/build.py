"""`build_optimizer`: the optimizer named by `training.optimizer`, with its split logged once."""
import logging

import torch
import torch.distributed as dist

from optim.muon_adamw import MuonAdamW

logger = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "muon_adamw")


def build_optimizer(named_parameters, training_cfg, world_size):
    """MuonAdamW or torch.optim.AdamW from `cfg.training`; groups carry "name" and "initial_lr"."""
    t = training_cfg
    named = list(named_parameters)
    if t.optimizer == "adamw":
        seen, params = set(), []
        for _, p in named:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        optimizer = torch.optim.AdamW([dict(params=params, name="adamw", initial_lr=t.learning_rate)],
                                      lr=t.learning_rate, betas=tuple(t.betas), eps=t.eps,
                                      weight_decay=t.weight_decay)
        lines = [f"adamw: {len(params)} tensors, {sum(p.numel() for p in params):,} parameters, "
                 f"lr {t.learning_rate:.3g}"]
    elif t.optimizer == "muon_adamw":
        m = t.muon
        optimizer = MuonAdamW(
            named, lr=t.learning_rate, weight_decay=t.weight_decay, betas=tuple(t.betas), eps=t.eps,
            muon_momentum=m.momentum, nesterov=m.nesterov, ns_steps=m.ns_steps,
            ns_coefficients=tuple(m.ns_coefficients), ns_dtype=m.ns_dtype, ns_method=m.ns_method,
            adjust_lr_fn=m.adjust_lr_fn, muon_lr_scale=m.muon_lr_scale, routing=m.routing,
            muon_include=None if m.include is None else list(m.include),
            muon_exclude=None if m.exclude is None else list(m.exclude),
            moe_num_experts=m.moe_num_experts, moe_top_k=m.moe_top_k, moe_expert_pattern=m.moe_expert_pattern,
            world_size=world_size)
        lines = optimizer.split_summary()
    else:
        raise ValueError(f"training.optimizer is {t.optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("optimizer %s, parameter split:\n  %s", t.optimizer, "\n  ".join(lines))
    return optimizer
