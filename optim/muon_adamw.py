"""MuonAdamW: Muon for hidden-layer matrices, AdamW for everything else, in one torch optimizer.

It runs in two modes, chosen per param group at each step:
- direct: the group holds tensors shaped like the model's (one device, plain DDP, DeepSpeed
  ZeRO-0: the model's own tensors in fp32, per-tensor fp32 copies in bf16). Every rank
  orthogonalises every matrix, same-shape ones as one stack.
- flat: DeepSpeed ZeRO-1/2 swapped the group's tensors for one flat fp32 partition: the
  momentum is kept in that flat layout and each matrix is orthogonalised by one owner
  rank (optim/partitioned.py).
The update rule and the state layout are in docs/optimizer.md; with `ns_dtype="bfloat16"` and
`ns_method="standard"` it is torch.optim.Muon's, and the AdamW group calls torch's own AdamW
kernel (optim/adamw.py). Defaults of the Muon arguments are MuonConfig's (optim/config.py).
"""
import math
import re
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as tdist

from optim.adamw import adamw_group_step
from optim.config import MuonConfig
from optim.config import ADJUST_LR_FNS, NS_METHODS
from optim.newton_schulz import DTYPES, matrix_cost, muon_lr, orthogonalize_stacks
from optim.ownership import balanced_order
from optim.partitioned import FlatMuonPlan, owner_step
from optim.routing import matrix_view, split_params
from optim.update import decay_weights, momentum_update

_MUON = MuonConfig()  # the one place the Muon defaults are written


class MuonAdamW(torch.optim.Optimizer):
    """Muon + AdamW over `named_parameters` (a model's `named_parameters()`).

    Param groups (only the non-empty ones exist): "muon" (matrices), "muon_experts"
    (MoE expert matrices, lr scaled by sqrt(moe_num_experts / moe_top_k)) and "adamw".
    Each carries "name", "lr" and "initial_lr"; a scheduler sets lr = initial_lr * m.
    `world_size` (default: the process group's) fixes the order of the Muon tensors
    inside their group so that ZeRO's partitions give every rank an equal share of the
    Newton-Schulz work (optim/ownership.py). `lr`, `weight_decay`, `betas`, `eps` default
    to torch.optim.AdamW's; the Muon arguments are MuonConfig's fields (`muon_momentum` is
    `momentum`, `muon_include` / `muon_exclude` are `include` / `exclude`).

    `fused_adamw`: the "adamw" group uses torch's fused AdamW kernel (optim/adamw.py).
    `flat_step`: how a flat (ZeRO-1/2) Muon group is orthogonalised and applied, a callable
    `flat_step(x, update, group, plan)` given the flat partition `x`, its `update` (momentum
    and Nesterov already applied, optim/update.py), the param group and the group's
    `FlatMuonPlan`; it applies weight decay and the orthogonalised update to `x` in place.
    Default `optim.partitioned.owner_step` (each matrix on one owner rank); the benchmark
    passes a gather-everything variant to compare against.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], lr: float = 1e-3,
                 weight_decay: float = 0.01, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 muon_momentum: float = _MUON.momentum, nesterov: bool = _MUON.nesterov, ns_steps: int = _MUON.ns_steps,
                 ns_coefficients: Sequence[float] = tuple(_MUON.ns_coefficients),
                 ns_dtype: str | torch.dtype = _MUON.ns_dtype, ns_method: str = _MUON.ns_method,
                 adjust_lr_fn: str = _MUON.adjust_lr_fn, muon_lr_scale: float = _MUON.muon_lr_scale,
                 routing: str = _MUON.routing, muon_include: Sequence[str] | None = _MUON.include,
                 muon_exclude: Sequence[str] | None = _MUON.exclude, moe_num_experts: int = _MUON.moe_num_experts,
                 moe_top_k: int = _MUON.moe_top_k, moe_expert_pattern: str = _MUON.moe_expert_pattern,
                 muon_eps: float = 1e-7, world_size: int | None = None, fused_adamw: bool = False,
                 flat_step: Callable[..., None] = owner_step) -> None:
        ns_dtype = _dtype_name(ns_dtype)
        _check_choice("ns_method", ns_method, NS_METHODS)
        _check_choice("adjust_lr_fn", adjust_lr_fn, ADJUST_LR_FNS)
        if len(ns_coefficients) != 3:
            raise ValueError(f"ns_coefficients is {ns_coefficients!r}; expected three numbers (a, b, c)")
        if moe_num_experts < 1 or not 1 <= moe_top_k <= moe_num_experts:
            raise ValueError(f"moe_num_experts={moe_num_experts}, moe_top_k={moe_top_k}: expected "
                             "1 <= moe_top_k <= moe_num_experts")
        if world_size is None:
            world_size = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
        muon, adam = split_params(named_parameters, routing, muon_include, muon_exclude)
        experts = []
        if moe_num_experts > 1:
            pattern = re.compile(moe_expert_pattern)
            experts = [(n, p) for n, p in muon if pattern.search(n)]
            muon = [(n, p) for n, p in muon if not pattern.search(n)]

        muon_keys = dict(momentum=muon_momentum, nesterov=nesterov, ns_steps=ns_steps,
                         ns_coefficients=tuple(float(c) for c in ns_coefficients), ns_dtype=ns_dtype,
                         ns_method=ns_method, adjust_lr_fn=adjust_lr_fn, muon_eps=muon_eps)
        moe_scale = math.sqrt(moe_num_experts / moe_top_k)
        specs = [("muon", muon, True, muon_lr_scale), ("muon_experts", experts, True, muon_lr_scale * moe_scale),
                 ("adamw", adam, False, 1.0)]
        groups, self._members = [], {}
        for name, members, is_muon, lr_scale in specs:
            if not members:
                continue
            if is_muon:
                members = _balanced(members, ns_steps, world_size)
            group = dict(params=[p for _, p in members], name=name, muon=is_muon, lr=lr, initial_lr=lr,
                         weight_decay=weight_decay)
            group.update(dict(muon_keys, lr_scale=lr_scale) if is_muon else dict(betas=tuple(betas), eps=eps))
            groups.append(group)
            self._members[name] = members
        if not groups:
            raise ValueError("MuonAdamW: no trainable parameters (every parameter has requires_grad=False)")
        super().__init__(groups, dict(lr=lr, weight_decay=weight_decay))
        self.plans: dict[str, FlatMuonPlan] = {}  # group name -> its plan
        self.fused_adamw, self.flat_step = fused_adamw, flat_step

    def members(self, group_name: str) -> list[tuple[str, torch.nn.Parameter]]:
        """The (name, param) pairs of a group, in the order the group holds them."""
        return list(self._members[group_name])

    def split_summary(self) -> list[str]:
        """One line per group: tensors, parameters, lr, lr scale (logged at start by build_optimizer)."""
        lines = []
        for g in self.param_groups:
            members = self._members[g["name"]]
            numel = sum(p.numel() for _, p in members)
            scale = f", update lr scale {g['lr_scale']:.4g}" if g["muon"] else ""
            lines.append(f"{g['name']}: {len(members)} tensors, {numel:,} parameters, lr {g['initial_lr']:.3g}{scale}")
        return lines

    def _is_flat(self, group: dict[str, Any]) -> bool:
        # Flat: a ZeRO partition. DeepSpeed's ZeRO-0 bf16 (unfused) optimizer hands per-tensor
        # fp32 copies instead: same shapes, so the direct path.
        params, own = group["params"], self._members[group["name"]]
        return not (len(params) == len(own) and all(a.shape == b.shape for a, (_, b) in zip(params, own)))

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # DeepSpeed ZeRO calls step() once per group with param_groups narrowed to that group.
        for group in self.param_groups:
            if not group["muon"]:
                adamw_group_step(self.state, group, self.fused_adamw)
            elif self._is_flat(group):
                self._flat_muon_step(group)
            else:
                self._direct_muon_step(group)
        return loss

    def plan(self, group: dict[str, Any]) -> FlatMuonPlan:
        """The FlatMuonPlan of a flat Muon group (built at its first step, rebuilt if the partition changes)."""
        flat = group["params"][0]
        plan = self.plans.get(group["name"])
        if plan is None or plan.partition_numel != flat.numel():
            plan = FlatMuonPlan(self._members[group["name"]], flat, group["ns_steps"])
            self.plans[group["name"]] = plan
        return plan

    def _flat_muon_step(self, group: dict[str, Any]) -> None:
        x = group["params"][0]
        if x.grad is not None:
            self.flat_step(x, momentum_update(self.state[x], x.grad, group), group, self.plan(group))

    def _direct_muon_step(self, group: dict[str, Any]) -> None:
        params, stacks = [], []
        for p in group["params"]:
            if p.grad is not None:
                params.append(p)
                stacks.append(momentum_update(self.state[p], p.grad, group).reshape(matrix_view(p.shape)))
        for p, o in zip(params, orthogonalize_stacks(stacks, group)):
            decay_weights(p, group)
            p.add_(o.reshape(p.shape), alpha=-muon_lr(group, o.shape))


def _balanced(members: Sequence[tuple[str, torch.nn.Parameter]], ns_steps: int,
              world_size: int) -> list[tuple[str, torch.nn.Parameter]]:
    order = balanced_order([p.numel() for _, p in members], [matrix_cost(p.shape, ns_steps) for _, p in members],
                           world_size)
    return [members[k] for k in order]


def _dtype_name(ns_dtype: str | torch.dtype) -> str:
    for name, dtype in DTYPES.items():
        if ns_dtype in (name, dtype):
            return name
    raise ValueError(f"ns_dtype is {ns_dtype!r}; expected one of {', '.join(DTYPES)}")


def _check_choice(key: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{key} is {value!r}; expected one of {', '.join(allowed)}")
