"""Resume a DeepSpeed checkpoint at another world size (W -> W'), optimizer state included.

ZeRO-1/2 keep, per param group, one flat buffer of all the group's tensors; rank r owns the
slice [r * P, (r + 1) * P) of it (P = padded group size / W), saved in its own
`zero_pp_rank_{r}_mp_rank_00_optim_states.pt`: the fp32 master slice and the base optimizer's
state for it (Adam's exp_avg / exp_avg_sq, the Muon momentum: flat, elementwise tensors).
DeepSpeed refuses to load those files at another world size, and its own re-partitioning
assumes that a group is flattened in the same order at every world size; MuonAdamW orders
the tensors of a group by world size (to balance Newton-Schulz work), so we instead rebuild
every piece by parameter name from a layout file saved beside the shards.

At save time every rank calls `save_layout(engine, engine_dir)` after `engine.save_checkpoint`.
At load time `reshard_if_needed(engine, engine_dir, saved_world_size)` returns False when the world
size is the same (then `engine.load_checkpoint` does the job) and otherwise loads the checkpoint
itself: this rank reads only the old slices that overlap its new partition (memory-mapped). The
world size a checkpoint was written at is recorded once, in its manifest (checkpoint/manifest.py);
a ZeRO layout implies it too (flat size / partition size). DeepSpeed's internals are read through
optim/deepspeed_adapter.py.

`python -m checkpoint describe <checkpoint_step_N>` prints what a checkpoint holds and
checks that every parameter can be rebuilt (no conversion command is needed: the slice a rank
owns depends on the optimizer's order at the new world size, known only once it is built).
"""
import glob
import json
import os
import re

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from checkpoint.files import (DEEPSPEED_MODEL_FILE, DEEPSPEED_OPTIMIZER_FILE, EMA_SHARD_FILE, ENGINE_DIR, LAYOUT_FILE,
                              rank_pattern)
from checkpoint.manifest import FORMAT
from optim.deepspeed_adapter import (DeepSpeedRuntime, PartitionGroup, base_optimizer, forget_linked_state,
                                     partition_groups, refresh_module_weights, restore_loss_scaler,
                                     restore_step_counters, zero_stage)

LAYOUT_FORMAT = 2
Shard = tuple[list[torch.Tensor], list[dict[str, Any]], dict[str, Any]]
"""One old rank's ZeRO shard: (fp32 master slice per group, optimizer state per group, its whole
`optimizer_state_dict`)."""


def shard_rank(name: str) -> int | None:
    """The rank that wrote DeepSpeed file `name` (its ZeRO optimizer shard), or None (rank 0's files)."""
    m = re.search(rank_pattern(DEEPSPEED_OPTIMIZER_FILE) + "$", name)
    return int(m.group(1)) if m else None


class CheckpointConvertError(RuntimeError):
    """A checkpoint that cannot be resumed at this world size; the message says why and what to do."""


def _param_names(engine: DeepSpeedRuntime) -> dict[int, str]:
    return _names_of(engine.module)


def _names_of(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _unsupported(engine: DeepSpeedRuntime) -> str | None:
    """Why this engine's checkpoints cannot move to another world size, or None."""
    stage = zero_stage(engine)
    if stage == 3 or (stage == 0 and (engine.bfloat16_enabled() or engine.fp16_enabled())):
        precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        return (f"resume at another world size supports ZeRO stage 1 and 2 (any precision) and stage 0 "
                f"in fp32; this checkpoint was written with stage {stage} in {precision}. Resume it at "
                "the world size it was written with, or train with ZeRO-1/2")
    return None


def _zero_layout(engine: DeepSpeedRuntime) -> list[dict[str, Any]]:
    """Every rank holds the same flat layout; rank r's slice follows from partition_size."""
    names = _param_names(engine)
    return [{"flat_numel": g.flat_numel, "partition_size": g.partition_size,
             "params": [{"name": names[id(p)], "shape": list(p.shape), "offset": offset}
                        for p, offset in zip(g.params, g.offsets)]}
            for g in partition_groups(engine)]


def layout_world_size(layout: dict[str, Any]) -> int:
    """The world size a ZeRO-1/2 layout was written at: each rank owns partition_size elements of
    every flat group (DeepSpeed pads a group to a multiple of the world size)."""
    group = layout["groups"][0]
    return group["flat_numel"] // group["partition_size"]


def _plain_layout(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Stage 0 / DDP: the optimizer sees whole tensors; record their order in each group."""
    names = _names_of(module)
    return [{"params": [{"name": names[id(p)], "shape": list(p.shape)} for p in group["params"]]}
            for group in optimizer.param_groups]


def _write_layout(engine_dir: str, zero_stage: int, groups: list[dict[str, Any]] | None,
                  unsupported: str | None = None) -> None:
    path = os.path.join(engine_dir, LAYOUT_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": LAYOUT_FORMAT, "zero_stage": zero_stage, "groups": groups,
                   "unsupported": unsupported}, f)
    os.replace(path + ".tmp", path)  # a reader never sees half a layout


def save_layout(engine: DeepSpeedRuntime, engine_dir: str) -> None:
    """Write `engine_dir/zero_layout.json` (rank 0 writes; call it on every rank after the save)."""
    if engine.global_rank != 0:
        return
    stage = zero_stage(engine)
    if _unsupported(engine):  # still record the stage: the same-size resume reads the layout
        _write_layout(engine_dir, stage, None, unsupported=_unsupported(engine))
    else:
        groups = _zero_layout(engine) if stage else _plain_layout(engine.module, engine.optimizer)
        _write_layout(engine_dir, stage, groups)


def save_plain_layout(module: torch.nn.Module, optimizer: torch.optim.Optimizer, engine_dir: str) -> None:
    """The same for a plain optimizer (DDP): its param order may depend on the world size too."""
    _write_layout(engine_dir, 0, _plain_layout(module, optimizer))


def read_layout(engine_dir: str) -> dict[str, Any]:
    path = os.path.join(engine_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        raise CheckpointConvertError(
            f"{path} does not exist: every checkpoint of format {FORMAT} (checkpoint/manifest.py) has one; the "
            "folder is damaged or was not written by this recipe")
    with open(path) as f:
        layout = json.load(f)
    if layout.get("format") != LAYOUT_FORMAT:
        raise CheckpointConvertError(f"{path}: layout format {layout.get('format')!r}; expected {LAYOUT_FORMAT}")
    return layout


def _load(path: str) -> dict[str, Any]:
    # Our own checkpoints hold pickled DeepSpeed objects (loss scaler, config): not weights_only.
    # mmap: a rank reads only the slices it needs, not every old rank's whole shard.
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


class ShardReader:
    """Per-parameter reads from the flat ZeRO shards of a checkpoint written at any world size."""

    def __init__(self, engine_dir: str) -> None:
        self.engine_dir = engine_dir
        self.layout = read_layout(engine_dir)
        if self.layout["zero_stage"] not in (1, 2) or self.layout["unsupported"]:
            raise CheckpointConvertError(f"{engine_dir}: stage {self.layout['zero_stage']} has no readable "
                                         f"ZeRO shards ({self.layout['unsupported'] or 'whole state'})")
        self.world_size = layout_world_size(self.layout)
        # name -> (group index, offset in the flat group, numel, shape)
        self.where: dict[str, tuple[int, int, int, torch.Size]] = {}
        for g, group in enumerate(self.layout["groups"]):
            for p in group["params"]:
                numel = int(torch.Size(p["shape"]).numel())
                self.where[p["name"]] = (g, p["offset"], numel, torch.Size(p["shape"]))
        self._shards: dict[int, Shard] = {}
        self._ema: dict[int, dict[str, Any]] = {}

    def ema_updates(self) -> int:
        """EMA updates taken by the saved EMA (rank 0's file)."""
        return self._ema_shard(0)["updates"]

    def _ema_shard(self, rank: int) -> dict[str, Any]:
        if rank not in self._ema:
            path = os.path.join(self.engine_dir, EMA_SHARD_FILE.format(rank=rank))
            if not os.path.isfile(path):
                raise CheckpointConvertError(f"{path} does not exist: the checkpoint was written without "
                                             "training.ema.enabled, or not by all of its ranks")
            self._ema[rank] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._ema[rank]

    def shard(self, rank: int) -> Shard:
        if rank not in self._shards:
            name = DEEPSPEED_OPTIMIZER_FILE.format(rank=rank)
            found = glob.glob(os.path.join(self.engine_dir, "*" + name))
            if len(found) != 1:
                raise CheckpointConvertError(
                    f"{self.engine_dir}: expected one {name} "
                    f"(the checkpoint was written by {self.world_size} ranks), found {len(found)}")
            sd = _load(found[0])["optimizer_state_dict"]
            state = sd["base_optimizer_state"]
            # rigid (default): the torch optimizer's state_dict, keyed by group index;
            # elastic_checkpoint: a list of per-group states
            per_group = [state["state"].get(g, {}) for g in range(len(self.layout["groups"]))] \
                if isinstance(state, dict) else state
            self._shards[rank] = (sd["single_partition_of_fp32_groups"], per_group, sd)
        return self._shards[rank]

    def state_keys(self, group: int) -> tuple[list[str], dict[str, Any]]:
        """Elementwise state keys and scalar state of an old group (from rank 0's shard)."""
        _, per_group, _ = self.shard(0)
        fp32 = self.shard(0)[0][group]
        # rigid shards keep the partition's padding in the state, elastic ones drop it like fp32's
        sizes = (self.layout["groups"][group]["partition_size"], fp32.numel())
        elementwise, scalars = [], {}
        for key, value in per_group[group].items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.dim() != 1 or value.numel() not in sizes:
                    raise CheckpointConvertError(
                        f"{self.engine_dir}: optimizer state '{key}' of group {group} has shape "
                        f"{tuple(value.shape)}; only flat elementwise state (one value per element of the "
                        f"partition of {sizes[0]}) can be moved to another world size")
                elementwise.append(key)
            else:
                scalars[key] = value.clone() if torch.is_tensor(value) else value
        return elementwise, scalars

    def read(self, name: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened `name` (key 'fp32' for the master weight, 'ema'
        for its moving average, else an optimizer state key)."""
        group, offset, _, _ = self.where[name]
        size = self.layout["groups"][group]["partition_size"]
        pieces = []
        lo, hi = offset + start, offset + stop
        while lo < hi:
            rank, local = divmod(lo, size)
            count = min(hi - lo, size - local)
            if key == "ema":
                source = self._ema_shard(rank)["partitions"][group]
            else:
                fp32, per_group, _ = self.shard(rank)
                source = fp32[group] if key == "fp32" else per_group[group][key]
            pieces.append(source[local:local + count])
            lo += count
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def full(self, name: str, key: str = "fp32") -> torch.Tensor:
        _, _, numel, shape = self.where[name]
        return self.read(name, key, 0, numel).reshape(shape).clone()


def _check_names(engine_dir: str, saved: Mapping[str, Sequence[int]], current: Mapping[str, Sequence[int]]) -> None:
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    wrong = [f"{n}: saved {tuple(saved[n])}, model {tuple(current[n])}"
             for n in current if n in saved and tuple(saved[n]) != tuple(current[n])]
    if missing or unexpected or wrong:
        raise CheckpointConvertError(
            f"{engine_dir}: the checkpoint's trainable parameters do not match the model's "
            f"(missing from the checkpoint: {missing[:5]}, not in the model: {unexpected[:5]}, "
            f"shape changed: {wrong[:5]}); resume needs the same model (use finetune.checkpoint_path "
            "to start a new run from these weights)")


@torch.no_grad()
def _load_buffers(module: torch.nn.Module, saved: Mapping[str, torch.Tensor], engine_dir: str) -> None:
    """The ZeRO partitions hold parameters only; the persistent buffers (e.g. the action position
    table, which a Motus checkpoint sets) come from the saved module state."""
    params = dict(module.named_parameters())
    names = [n for n in module.state_dict() if n not in params]
    missing = [n for n in names if n not in saved]
    if missing:
        raise CheckpointConvertError(f"{engine_dir}: the saved module lacks the buffers {missing[:5]}; resume "
                                     "needs the same model (use finetune.checkpoint_path to start a new run)")
    for name in names:
        module.get_buffer(name).copy_(saved[name])


def _checked_reader(engine: DeepSpeedRuntime,
                    engine_dir: str) -> tuple[ShardReader, list[PartitionGroup], dict[int, str]]:
    reader, groups, names = ShardReader(engine_dir), partition_groups(engine), _param_names(engine)
    current = {names[id(p)]: p.shape for g in groups for p in g.params}
    _check_names(engine_dir, {n: w[3] for n, w in reader.where.items()}, current)
    return reader, groups, names


def _partition_from(reader: ShardReader, group: PartitionGroup, names: Mapping[int, str],
                    keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """{key: this rank's new flat partition of `group`}, each element read by parameter name."""
    size, begin = group.partition_size, group.begin
    new = {key: torch.zeros(size, dtype=reader.read(names[id(group.params[0])], key, 0, 1).dtype) for key in keys}
    for p, offset in zip(group.params, group.offsets):
        lo, hi = max(begin, offset), min(begin + size, offset + p.numel())
        if lo >= hi:
            continue  # this tensor has no piece in this rank's partition
        for key, target in new.items():
            target[lo - begin:hi - begin] = reader.read(names[id(p)], key, lo - offset, hi - offset)
    return new


@torch.no_grad()
def ema_partitions_from(engine: DeepSpeedRuntime, engine_dir: str) -> tuple[int, list[torch.Tensor]]:
    """(updates, this rank's EMA partitions) from a checkpoint written at any world size, by
    parameter name like the fp32 masters. Collective only in that every rank reads its own slice."""
    reader, groups, names = _checked_reader(engine, engine_dir)
    return reader.ema_updates(), [_partition_from(reader, g, names, ["ema"])["ema"] for g in groups]


@torch.no_grad()
def _install_zero(engine: DeepSpeedRuntime, engine_dir: str) -> None:
    reader, groups, names = _checked_reader(engine, engine_dir)
    base = base_optimizer(engine)
    for i, group in enumerate(groups):
        old_groups = sorted({reader.where[names[id(p)]][0] for p in group.params})
        if len(old_groups) != 1:
            raise CheckpointConvertError(
                f"{engine_dir}: param group {i} holds tensors of saved groups {old_groups}; "
                "the param-group split changed since the save, resume with the same optimizer routing")
        elementwise, scalars = reader.state_keys(old_groups[0])
        fp32 = group.master
        new = _partition_from(reader, group, names, ["fp32"] + elementwise)
        fp32.copy_(new.pop("fp32"))
        state = base.state[base.param_groups[i]["params"][0]]
        for key, value in new.items():
            if key in state and torch.is_tensor(state[key]) and state[key].shape == value.shape:
                state[key].copy_(value)  # keep tensors that something may already point at
            else:
                state[key] = value.to(fp32.device)
        state.update(scalars)  # the groups' options stay this run's (optim/hyperparameters.py)
    forget_linked_state(engine)  # DeepSpeed's views of the state are rebuilt on the tensors installed here
    refresh_module_weights(engine)  # the bit16 model weights from the new fp32 masters (all-gather)
    restore_loss_scaler(engine, reader.shard(0)[2])


def optimizer_state_by_name(saved: dict[str, Any], engine_dir: str, module: torch.nn.Module,
                            optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A whole optimizer state dict `saved` (stage 0, DDP), renumbered from the order recorded in
    `engine_dir`'s layout into `optimizer`'s order, for `optimizer.load_state_dict`."""
    layout = read_layout(engine_dir)
    names = _names_of(module)
    saved_order = [p["name"] for group in layout["groups"] for p in group["params"]]
    current = {names[id(p)]: p.shape for group in optimizer.param_groups for p in group["params"]}
    _check_names(engine_dir, {p["name"]: p["shape"] for g in layout["groups"] for p in g["params"]}, current)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointConvertError(
            f"{engine_dir}: {len(saved['param_groups'])} saved param groups, this optimizer has "
            f"{len(optimizer.param_groups)}; resume with the same optimizer routing")
    index_of = {name: i for i, name in enumerate(saved_order)}
    state, groups, next_index = {}, [], 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        ids = []
        for p in group["params"]:
            old = index_of[names[id(p)]]
            if old in saved["state"]:
                state[next_index] = saved["state"][old]
            ids.append(next_index)
            next_index += 1
        groups.append({**saved_group, "params": ids})
    return {"state": state, "param_groups": groups}


def master_weights(engine_dir: str) -> dict[str, torch.Tensor]:
    """{name: fp32 master weight} of the trainable tensors of a ZeRO-1/2 checkpoint (any world
    size), or {} for a checkpoint without ZeRO shards (DDP, stage 0: the module weights are the
    masters)."""
    layout = read_layout(engine_dir)
    if layout["zero_stage"] not in (1, 2) or layout["unsupported"]:
        return {}
    reader = ShardReader(engine_dir)
    return {name: reader.full(name) for name in reader.where}


def reshard_if_needed(engine: DeepSpeedRuntime, engine_dir: str, saved_world_size: int) -> bool:
    """Load `engine_dir` into `engine` when it was written at another world size (`saved_world_size`).

    Returns False (nothing done) when the world size is the same: call `engine.load_checkpoint`.
    Returns True when this function loaded weights, optimizer state and the engine's step
    counters; do not call `engine.load_checkpoint` then. Collective: call on every rank.
    """
    model_states_path = os.path.join(engine_dir, DEEPSPEED_MODEL_FILE)
    if not os.path.isfile(model_states_path):
        raise CheckpointConvertError(
            f"{engine_dir} holds no DeepSpeed state ({DEEPSPEED_MODEL_FILE}); was it written without "
            "--deepspeed? Resume with the launcher options it was written with")
    layout = read_layout(engine_dir)
    if saved_world_size == engine.dp_world_size:
        return False
    if layout["unsupported"] or _unsupported(engine):
        raise CheckpointConvertError(f"{engine_dir}: {layout['unsupported'] or _unsupported(engine)}")
    stage = zero_stage(engine)
    if layout["zero_stage"] != stage:
        raise CheckpointConvertError(
            f"{engine_dir}: written with ZeRO stage {layout['zero_stage']}, this run uses stage {stage}; "
            "resume with the stage of the checkpoint")
    model_states = _load(model_states_path)
    if stage:
        _install_zero(engine, engine_dir)
        _load_buffers(engine.module, model_states["module"], engine_dir)
    else:
        result = engine.module.load_state_dict(model_states["module"], strict=False)
        trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
        if set(result.missing_keys) & trainable or result.unexpected_keys:
            raise CheckpointConvertError(
                f"{engine_dir}: the saved module does not match the model (missing "
                f"{sorted(set(result.missing_keys) & trainable)[:5]}, unexpected {result.unexpected_keys[:5]})")
        engine.optimizer.load_state_dict(
            optimizer_state_by_name(model_states["optimizer"], engine_dir, engine.module, engine.optimizer))
    restore_step_counters(engine, model_states)
    return True


def describe(checkpoint_dir: str, world_size: int | None = None) -> str:
    """A summary of `checkpoint_dir` (a checkpoint_step_N folder), after reading every tensor once.
    `world_size`: the one its manifest records (None: a ZeRO layout implies it)."""
    engine_dir = os.path.join(checkpoint_dir, ENGINE_DIR)
    layout = read_layout(engine_dir)
    if world_size is None and layout["zero_stage"] in (1, 2) and not layout["unsupported"]:
        world_size = layout_world_size(layout)
    lines = [f"{checkpoint_dir}: written by {world_size or 'an unknown number of'} ranks, "
             f"ZeRO stage {layout['zero_stage']}"]
    if layout["unsupported"]:
        return "\n".join(lines + [f"  {layout['unsupported']}"])
    if layout["zero_stage"] == 0:
        count = sum(len(g["params"]) for g in layout["groups"])
        return "\n".join(lines + [f"  {count} tensors; stage 0 state is whole: any world size loads it"])
    reader = ShardReader(engine_dir)
    for g, group in enumerate(layout["groups"]):
        elementwise, scalars = reader.state_keys(g)
        for p in group["params"]:
            for key in ["fp32"] + elementwise:
                reader.full(p["name"], key)
        numel = sum(reader.where[p["name"]][2] for p in group["params"])
        shown = {k: (v.item() if torch.is_tensor(v) else v) for k, v in scalars.items()}
        lines.append(f"  group {g}: {len(group['params'])} tensors, {numel} elements, "
                     f"state {['fp32'] + elementwise}, scalars {shown}")
    lines.append("  every tensor is readable: resume at any world size with resume.checkpoint_path")
    return "\n".join(lines)
