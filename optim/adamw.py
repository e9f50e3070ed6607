"""The AdamW update of MuonAdamW's "adamw" group and of plain AdamW, on torch's own kernels.

Two implementations of the same AdamW (torch.optim.adamw.adamw), chosen by `fused_adamw`:
- False: torch's default, as torch.optim.AdamW() picks it (a foreach kernel on CUDA, a loop
  over tensors on the CPU); the step counter lives on the CPU.
- True: torch's fused kernel (one launch per device and dtype, on CUDA and on the CPU),
  as torch.optim.AdamW(fused=True); the step counter lives on the parameter's device.
They differ by fp32 round-off only. Under ZeRO-1/2 the group holds one flat fp32 partition,
which either kernel updates as one tensor.

The step counter is moved to where the chosen kernel wants it whenever it is elsewhere (a
checkpoint written with the other setting, or resharded to another world size), so either
setting resumes from either; the setting of the run, not the checkpoint's, decides.
"""
import torch
from torch.optim.adamw import adamw
from torch.optim.optimizer import _get_scalar_dtype
from typing import Any, Mapping


def kernel_args(fused_adamw: bool) -> dict[str, bool | None]:
    """torch AdamW's `fused` argument for the setting (None: torch's default choice)."""
    return dict(fused=True if fused_adamw else None)


def place_step(state: dict[str, Any], param: torch.Tensor, fused_adamw: bool) -> None:
    """Create AdamW's state for `param` if missing (as torch.optim.AdamW does) and put the step
    counter on the device and dtype the chosen kernel expects. Metadata checks only: no host sync."""
    device = param.device if fused_adamw else torch.device("cpu")
    dtype = torch.float32 if fused_adamw else _get_scalar_dtype()
    if not state:
        state["step"] = torch.zeros((), dtype=dtype, device=device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    elif state["step"].device != device or state["step"].dtype != dtype:
        state["step"] = state["step"].to(device=device, dtype=dtype)


def adamw_group_step(optimizer_state: Mapping[torch.Tensor, dict[str, Any]], group: dict[str, Any],
                     fused_adamw: bool) -> None:
    """One AdamW step of a param group with "betas", "eps", "lr", "weight_decay"."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        state = optimizer_state[p]
        place_step(state, p, fused_adamw)
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    if params:
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
              **kernel_args(fused_adamw))


def keep_kernel(optimizer: torch.optim.Optimizer, fused_adamw: bool) -> torch.optim.Optimizer:
    """For a torch.optim.AdamW: before every step, restore the run's kernel choice (a loaded
    state dict brings the saved one) and place the step counters for it."""
    def hook(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for group in opt.param_groups:
            group.update(kernel_args(fused_adamw), foreach=None)
            for p in group["params"]:
                if opt.state.get(p):
                    place_step(opt.state[p], p, fused_adamw)
    optimizer.register_step_pre_hook(hook)
    return optimizer
