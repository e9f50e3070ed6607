"""Muon + AdamW for the recipe: `build_optimizer(model.named_parameters(), cfg.training, world_size)`.

Modules: routing.py (which tensors go to Muon), newton_schulz.py (kernels, lr adjustment),
ownership.py (owner rule, balanced order), partitioned.py (the ZeRO-1/2 step),
muon_adamw.py (the optimizer), build.py (from the config).

Param groups, in this order, only those that are non-empty:
  "muon" (Muon matrices), "muon_experts" (MoE expert matrices), "adamw" (everything else).
Every group has "name", "lr", "initial_lr", "weight_decay" and "muon" (bool); Muon groups
add momentum, nesterov, ns_steps, ns_coefficients, ns_dtype, ns_method, adjust_lr_fn,
muon_eps and lr_scale (applied to the orthogonalised update only); "adamw" adds betas, eps.

Parameter order inside a Muon group is a function of the world size W given at
construction: `MuonAdamW(named_parameters, ..., world_size=W).members("muon")` returns the
(name, param) pairs in that order (ownership.balanced_order; W=1: model order). The
"adamw" group keeps model order. Tied parameters appear once (first name).

Optimizer state (what checkpoints hold):
- Not partitioned (one device, DDP, ZeRO-0): torch layout, per parameter. Muon tensors:
  {"momentum_buffer": fp32 like the parameter}; AdamW tensors: {"step": 0-d fp32 tensor,
  "exp_avg", "exp_avg_sq": like the parameter} (exactly torch.optim.AdamW's state).
- ZeRO-1/2: DeepSpeed saves the base optimizer's state_dict per rank in
  `{dir}/{tag}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt` under
  ["optimizer_state_dict"]["base_optimizer_state"]: "state"[i] is group i's state on the
  rank's flat fp32 partition of P_i elements: Muon groups {"momentum_buffer": [P_i]}, the
  AdamW group {"step": 0-d, "exp_avg": [P_i], "exp_avg_sq": [P_i]}; "param_groups"[i]
  holds the group's keys above. The group's tensors lie back to back in the group order
  (no gaps unless zero_optimization.parameter_alignment is set: then the per-tensor pads
  are ["optimizer_state_dict"]["param_alignment_paddings"]), the whole padded to a
  multiple of 2 * W with zeros at the end; rank r holds elements [r * P_i, (r + 1) * P_i).
  To rebuild per-parameter tensors: use ["optimizer_state_dict"]["param_slice_mappings"][i]
  ({name: fragment_address(start, numel)} of each tensor's piece in that rank's partition);
  a tensor's pieces across ranks, taken in rank order, concatenate to the flattened tensor:
  full = cat_r(state_r[i][key][start_r : start_r + numel_r]).view(shape).
  To write state for another world size W': build the model and MuonAdamW(world_size=W'),
  call deepspeed.initialize, then `optimizer.init_state()` (zeros, as the first step
  would) and copy each tensor's slice into the partition through its `_hp_mapping`:
  state[key][hp.start : hp.start + n] = full.flatten()[lp.start : lp.start + n] with
  hp = p._hp_mapping.hp_fragment_address, lp = p._hp_mapping.lp_fragment_address.
  Momentum is elementwise, so this conversion is exact.
"""
from optim.build import build_optimizer
from optim.muon_adamw import MuonAdamW

__all__ = ["MuonAdamW", "build_optimizer"]
