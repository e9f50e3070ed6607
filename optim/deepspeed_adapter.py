"""Every read or write of DeepSpeed's internal state, in one module.

The recipe hands its own optimizer (MuonAdamW) to DeepSpeed and then needs things DeepSpeed does not
offer as an API: the client optimizer inside the ZeRO wrapper, the fp32 master partitions and where
each tensor lies in them, the skip counter, the step counters and the loss scaler of a checkpoint.
Those are attributes of DeepSpeed's engine and of its ZeRO-1/2 optimizer (`DeepSpeedZeroOptimizer`,
deepspeed/runtime/zero/stage_1_and_2.py) and of the parameters it maps (`_hp_mapping`). Only this
module names them, so a DeepSpeed upgrade that renames one breaks here and nowhere else.

It lives in optim/ (layer 1, tests/test_imports.py) because optim/partitioned.py reads the parameters'
mappings; checkpoint/zero.py and train/ use it from above. It imports no DeepSpeed module at import
time: `deepspeed` is imported only by the functions that need its communicator.
"""
from typing import Any, Callable, NamedTuple, Optional

import torch

DeepSpeedRuntime = Any
"""DeepSpeed's own engine, `deepspeed.runtime.engine.DeepSpeedEngine` (typed as Any: the package is
untyped); train/deepspeed_engine.py's `DeepSpeedEngine` holds one as `.ds`."""


class PartitionGroup(NamedTuple):
    """One ZeRO-1/2 param group on this rank: its tensors and where they lie in the group's flat buffer."""
    params: list[torch.Tensor]
    offsets: list[int]
    """Start of each tensor in the group's flat (padded) buffer, in elements."""
    partition_size: int
    """Elements of the flat buffer each rank owns: rank r owns [r * size, (r + 1) * size)."""
    begin: int
    """Start of this rank's partition in the flat buffer."""
    flat_numel: int
    """Elements of the whole padded flat buffer (partition_size x world size)."""
    master: torch.Tensor
    """This rank's fp32 master partition (flat), which the optimizer updates in place."""


def _zero(ds: DeepSpeedRuntime) -> Any:
    return ds.optimizer


def base_optimizer(ds: DeepSpeedRuntime) -> torch.optim.Optimizer:
    """The client optimizer (the one the recipe built) inside DeepSpeed's ZeRO or bf16 wrapper."""
    return ds.optimizer.optimizer if hasattr(ds.optimizer, "optimizer") else ds.optimizer


def zero_stage(ds: DeepSpeedRuntime) -> int:
    return ds.zero_optimization_stage() if ds.zero_optimization() else 0


def has_master_partitions(ds: DeepSpeedRuntime) -> bool:
    """ZeRO-1/2: every rank holds a flat fp32 partition of each param group."""
    return zero_stage(ds) in (1, 2)


def fp32_partitions(ds: DeepSpeedRuntime) -> list[torch.Tensor]:
    """This rank's fp32 master weights under ZeRO-1/2: one flat tensor per param group (the
    slice of the group's padded flat buffer that this rank owns and updates)."""
    return list(_zero(ds).single_partition_of_fp32_groups)


def partition_groups(ds: DeepSpeedRuntime) -> list[PartitionGroup]:
    """The ZeRO-1/2 param groups of `ds` on this rank (collective-free)."""
    import deepspeed.comm as ds_dist

    zero = _zero(ds)
    groups = []
    for i, params in enumerate(zero.round_robin_bit16_groups):
        size = int(zero.partition_size[i])
        groups.append(PartitionGroup(
            params=list(params), offsets=[int(o) for o in zero.round_robin_bit16_offsets[i]],
            partition_size=size, begin=size * ds_dist.get_rank(group=zero.real_dp_process_group[i]),
            flat_numel=int(zero.bit16_groups_flat[i].numel()), master=zero.single_partition_of_fp32_groups[i]))
    return groups


def refresh_module_weights(ds: DeepSpeedRuntime) -> None:
    """Copy the fp32 partitions into the module's weights (all-gathered across ranks, as after a step)."""
    _zero(ds).update_lp_params()


def count_skipped_step(ds: DeepSpeedRuntime) -> None:
    """Count a step the recipe suppressed (stage 0 fp32) in DeepSpeed's own skip counter, which it
    otherwise counts as taken."""
    ds.skipped_steps += 1


def guard_client_step(optimizer: torch.optim.Optimizer, skip: Callable[[], bool]) -> None:
    """Make `optimizer.step()` do nothing while `skip()` is true. DeepSpeed stage 0 calls the client
    optimizer's step itself, inside `engine.step()`, with no hook to veto it: the method is replaced
    on this instance."""
    step = optimizer.step

    def guarded(*args: Any, **kwargs: Any) -> Any:
        return None if skip() else step(*args, **kwargs)
    optimizer.step = guarded  # type: ignore[method-assign]


def forget_linked_state(ds: DeepSpeedRuntime) -> None:
    """DeepSpeed links optimizer-state views into each parameter lazily after the first step; drop any
    earlier links, so that they are rebuilt on optimizer state installed by the recipe."""
    zero = _zero(ds)
    if hasattr(zero, "_hp_optimizer_states_linked"):
        zero._hp_optimizer_states_linked = False


def restore_loss_scaler(ds: DeepSpeedRuntime, saved_optimizer_state: dict[str, Any]) -> None:
    """The loss scaler of a saved ZeRO shard (`optimizer_state_dict` of rank 0's file)."""
    zero = _zero(ds)
    for key in ("loss_scaler", "dynamic_loss_scale", "overflow"):
        if key in saved_optimizer_state:
            setattr(zero, key, saved_optimizer_state[key])


def restore_step_counters(ds: DeepSpeedRuntime, model_states: dict[str, Any]) -> None:
    """The engine's step, sample and skip counters (and its lr scheduler, unused here) from a saved
    `mp_rank_00_model_states.pt`."""
    ds.global_steps = model_states["global_steps"]
    ds.global_samples = model_states["global_samples"]
    ds.skipped_steps = model_states["skipped_steps"]
    if ds.lr_scheduler is not None and model_states.get("lr_scheduler") is not None:
        ds.lr_scheduler.load_state_dict(model_states["lr_scheduler"])


# --- the parameters' mapping into the flat partitions (optim/partitioned.py) -------------------
def has_fragment_mapping(p: torch.Tensor) -> bool:
    """Whether DeepSpeed mapped model tensor `p` into flat fp32 partitions (ZeRO-1/2)."""
    return hasattr(p, "_hp_mapping")


def fragment(p: torch.Tensor) -> Optional[tuple[int, int, int]]:
    """(start in the tensor, numel, start in this rank's partition) of the piece of `p` this rank
    holds, or None when it holds none."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    return (mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel,
            mapping.hp_fragment_address.start)


def data_parallel_group(params: list[torch.Tensor]) -> Any:
    """The data-parallel process group DeepSpeed partitions these tensors over (None: the default group)."""
    return next((p._dp_group for p in params if getattr(p, "_dp_group", None) is not None), None)
