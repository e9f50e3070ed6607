"""WorldModel export: `config.json` + `model.safetensors`, sharded like transformers above a size
(`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`)."""
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:  # world_model imports this module
    from models.world_model import WorldModel

DEFAULT_SHARD_BYTES = 5 * 1024 ** 3
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class ModelLoadError(RuntimeError):
    """A folder that does not hold what it should: the message names the path and what is missing."""


def save(model: "WorldModel", directory: str | os.PathLike[str], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    save_state(model.spec, model.state_dict(), directory, max_shard_bytes)


def save_state(spec: Mapping[str, Any], state: Mapping[str, torch.Tensor], directory: str | os.PathLike[str],
               max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """config.json (`spec`) + the tensors of `state` ({name: tensor}), sharded above max_shard_bytes."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(spec, f, indent=2, sort_keys=True)
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    shards: list[dict] = []
    current: dict = {}
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG_NAME)
    if not os.path.isfile(path):
        raise ModelLoadError(f"'{directory}' has no {CONFIG_NAME}: expected a folder written by "
                             "WorldModel.save_pretrained")
    with open(path) as f:
        return json.load(f)


def read_state_dict(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of an exported folder (single file or sharded)."""
    single, index = os.path.join(directory, WEIGHTS_NAME), os.path.join(directory, INDEX_NAME)
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for fname in files:
            state.update(load_file(os.path.join(directory, fname)))
        return state
    raise ModelLoadError(f"'{directory}' has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def load_weights(model: "WorldModel", directory: str | os.PathLike[str],
                 device: torch.device | str = "cpu") -> "WorldModel":
    """Load an exported folder into `model` (parameters may be on meta); every key must match."""
    state = read_state_dict(directory)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(f"'{directory}' does not match the model in its {CONFIG_NAME}: "
                             f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                             f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
    return model.to(device)


def count_parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

