"""MuonAdamW: Muon for hidden-layer matrices, AdamW for everything else, in one torch optimizer.

It runs in two modes, chosen per param group at each step:
- direct: the group holds tensors shaped like the model's (one device, plain DDP, DeepSpeed
  ZeRO-0: the model's own tensors in fp32, per-tensor fp32 copies in bf16). Every rank
  orthogonalises every matrix, same-shape ones as one stack.
- flat: DeepSpeed ZeRO-1/2 swapped the group's tensors for one flat fp32 partition: the
  momentum is kept in that flat layout and each matrix is orthogonalised by one owner
  rank (optim/partitioned.py).
The update rule is DESIGN.md section 5; with `ns_dtype="bfloat16"` and `ns_method="standard"`
it is torch.optim.Muon's, and the AdamW groups call torch's own AdamW kernel.
"""
import math
import re

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw
from torch.optim.optimizer import _get_scalar_dtype

from optim.newton_schulz import (ADJUST_LR_FNS, DTYPES, NS_METHODS, muon_lr, ns_flops,
                                  orthogonalize_stacks)
from optim.ownership import balanced_order
from optim.partitioned import FlatMuonPlan, flat_muon_step
from optim.routing import matrix_view, split_params

DEFAULT_MOE_EXPERT_PATTERN = r"(^|\.)experts?\."


class MuonAdamW(torch.optim.Optimizer):
    """Muon + AdamW over `named_parameters` (a model's `named_parameters()`).

    Param groups (only the non-empty ones exist): "muon" (matrices), "muon_experts"
    (MoE expert matrices, lr scaled by sqrt(moe_num_experts / moe_top_k)) and "adamw".
    Each carries "name", "lr" and "initial_lr"; a scheduler sets lr = initial_lr * m.
    `world_size` (default: the process group's) fixes the order of the Muon tensors
    inside their group so that ZeRO's partitions give every rank an equal share of the
    Newton-Schulz work (optim/ownership.py).
    """

    def __init__(self, named_parameters, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8,
                 muon_momentum=0.95, nesterov=True, ns_steps=5, ns_coefficients=(3.4445, -4.7750, 2.0315),
                 ns_dtype="bfloat16", ns_method="standard", adjust_lr_fn="match_rms_adamw",
                 muon_lr_scale=1.0, routing="all_hidden", muon_include=None, muon_exclude=None,
                 moe_num_experts=1, moe_top_k=1, moe_expert_pattern=DEFAULT_MOE_EXPERT_PATTERN,
                 muon_eps=1e-7, world_size=None):
        ns_dtype = _dtype_name(ns_dtype)
        _check_choice("ns_method", ns_method, NS_METHODS)
        _check_choice("adjust_lr_fn", adjust_lr_fn, ADJUST_LR_FNS)
        if len(ns_coefficients) != 3:
            raise ValueError(f"ns_coefficients is {ns_coefficients!r}; expected three numbers (a, b, c)")
        if moe_num_experts < 1 or not 1 <= moe_top_k <= moe_num_experts:
            raise ValueError(f"moe_num_experts={moe_num_experts}, moe_top_k={moe_top_k}: expected "
                             "1 <= moe_top_k <= moe_num_experts")
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
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
        self._plans = {}

    def members(self, group_name):
        """The (name, param) pairs of a group, in the order the group holds them."""
        return list(self._members[group_name])

    def split_summary(self):
        """One line per group: tensors, parameters, lr, lr scale (logged at start by build_optimizer)."""
        lines = []
        for g in self.param_groups:
            members = self._members[g["name"]]
            numel = sum(p.numel() for _, p in members)
            scale = f", update lr scale {g['lr_scale']:.4g}" if g["muon"] else ""
            lines.append(f"{g['name']}: {len(members)} tensors, {numel:,} parameters, lr {g['initial_lr']:.3g}{scale}")
        return lines

    def _is_flat(self, group):
        # Flat: a ZeRO partition. DeepSpeed's ZeRO-0 bf16 (unfused) optimizer hands per-tensor
        # fp32 copies instead: same shapes, so the direct path.
        params, own = group["params"], self._members[group["name"]]
        return not (len(params) == len(own) and all(a.shape == b.shape for a, (_, b) in zip(params, own)))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # DeepSpeed ZeRO calls step() once per group with param_groups narrowed to that group.
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_step(group)
            elif self._is_flat(group):
                self._flat_muon_step(group)
            else:
                self._direct_muon_step(group)
        return loss

    def _flat_muon_step(self, group):
        flat_muon_step(self, group, self._plan(group))

    def _plan(self, group):
        flat = group["params"][0]
        plan = self._plans.get(group["name"])
        if plan is None or plan.partition_numel != flat.numel():
            plan = FlatMuonPlan(self._members[group["name"]], flat, group["ns_steps"])
            self._plans[group["name"]] = plan
        return plan

    def _adamw_step(self, group):
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # the same state torch.optim.AdamW creates
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = group["betas"]
            adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _direct_muon_step(self, group):
        mu, params, stacks = group["momentum"], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            buf = self.state[p].get("momentum_buffer")
            if buf is None:
                buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            buf.lerp_(p.grad, 1 - mu)
            update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            params.append(p)
            stacks.append(update.reshape(matrix_view(p.shape)))
        for p, o in zip(params, orthogonalize_stacks(stacks, group)):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(o.reshape(p.shape), alpha=-muon_lr(group, o.shape))

    def init_state(self):
        """Create every state tensor now (zeros), as the first step would: lets a checkpoint
        converter address state fragments (DeepSpeed's safe_set_full_optimizer_state) before training."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    continue
                if group["muon"]:
                    state["momentum_buffer"] = torch.zeros_like(p)
                else:
                    state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _balanced(members, ns_steps, world_size):
    views = [matrix_view(p.shape) for _, p in members]
    order = balanced_order([p.numel() for _, p in members],
                           [c * ns_flops(a, b, ns_steps) for c, a, b in views], world_size)
    return [members[k] for k in order]


def _dtype_name(ns_dtype):
    for name, dtype in DTYPES.items():
        if ns_dtype in (name, dtype):
            return name
    raise ValueError(f"ns_dtype is {ns_dtype!r}; expected one of {', '.join(DTYPES)}")


def _check_choice(key, value, allowed):
    if value not in allowed:
        raise ValueError(f"{key} is {value!r}; expected one of {', '.join(allowed)}")
