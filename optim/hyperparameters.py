"""On resume the YAML's hyperparameters win over the checkpoint's; its optimizer *state* is kept.

torch's `Optimizer.load_state_dict` (which DeepSpeed's loads call too) brings back each param
group's options as they were at the save: lr and its schedule base `initial_lr`, weight decay,
betas, eps, Muon's momentum / nesterov / ns_steps / lr adjustment, the MoE lr scale. A run
resumed with an edited YAML must train with the edited values, so the engine takes the
options of the freshly built groups (built from the YAML) before it loads a checkpoint and puts
them back afterwards (`train.engine.Engine.load`). The state (moments, momentum buffers, step
counts) is untouched.
"""
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def group_options(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's options (all but its tensors), in group order."""
    return [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]


def apply_group_options(optimizer: torch.optim.Optimizer, options: Sequence[Mapping[str, Any]]) -> None:
    """Set the options taken by `group_options` on `optimizer`'s groups (the same groups, by name)."""
    groups = optimizer.param_groups
    names = [g.get("name") for g in groups]
    if names != [o.get("name") for o in options]:
        raise ValueError(f"the loaded optimizer has param groups {names}, this run built "
                         f"{[o.get('name') for o in options]}; resume with the same optimizer and routing, "
                         "or set resume.reset_optimizer=true")
    for group, own in zip(groups, options):
        group.update(own)
