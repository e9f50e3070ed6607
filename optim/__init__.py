"""Muon + AdamW for the recipe: `build_optimizer(model.named_parameters(), cfg.training, world_size)`.

Modules: routing.py (which tensors go to Muon), newton_schulz.py (kernels, lr adjustment),
ownership.py (owner rule, balanced order), update.py (momentum, weight decay),
partitioned.py (the ZeRO-1/2 step), adamw.py (the AdamW kernels), muon_adamw.py (the
optimizer), build.py (from the config), plan.py (`python -m optim.plan`: the Muon cost at
cluster scale).

Param groups, parameter order and the optimizer state that checkpoints hold (per tensor, and
on ZeRO-1/2's flat partitions) are described in docs/optimizer.md.
"""
from optim.build import build_optimizer
from optim.muon_adamw import MuonAdamW

__all__ = ["MuonAdamW", "build_optimizer"]
