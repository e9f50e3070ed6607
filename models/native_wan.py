"""Wan2.2's own files (the Wan-AI/Wan2.2-TI2V-5B download Motus's README points at), loaded into
the diffusers/transformers classes the recipe trains.

- transformer: a folder with Wan's config.json (`dim`, `num_heads`, `in_dim`, `model_type`, ...) and
  `diffusion_pytorch_model*.safetensors` in Wan's key names; diffusers' own
  `convert_wan_transformer_to_diffusers` renames them.
- VAE: `Wan2.2_VAE.pth`. diffusers' `convert_wan_vae_to_diffusers` knows the Wan2.1 layout only; the
  2.2 VAE nests its residual blocks one level deeper (`encoder.downsamples.i.downsamples.j`), which
  `_vae22_block_key` renames first, leaving the rest to diffusers' converter.
- umT5: `models_t5_umt5-xxl-enc-bf16.pth` (Wan's own T5 module) with the tokenizer folder
  `google/umt5-xxl` beside it; neither transformers nor diffusers converts it, `UMT5_KEYS` does.

The architecture comes from Wan's config.json (transformer) or the size table (VAE, umT5: the .pth
files carry none, and Wan hard-codes the VAE's latent statistics, which sizes.py holds). Every tensor
must match that architecture in name and shape, or the error names the key; nothing is left at init.
"""
import glob
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from models.serialization import ModelLoadError
from models.sizes import ModelSize

if TYPE_CHECKING:  # imported where used: reading a recipe does not load them
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

log = logging.getLogger(__name__)
M = TypeVar("M", bound=torch.nn.Module)

NATIVE_CONFIG_KEYS = ("dim", "num_heads", "num_layers", "in_dim")
TRANSFORMER_WEIGHTS = "diffusion_pytorch_model"
TOKENIZER_SUBFOLDER = os.path.join("google", "umt5-xxl")  # where Wan2.2-TI2V-5B keeps it
NATIVE_FILE_SUFFIXES = (".pth", ".pt")
VAE_FILE, UMT5_FILE = "Wan2.2_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth"  # their names in Wan2.2-TI2V-5B

# Wan's T5Encoder (wan/modules/t5.py) -> transformers UMT5EncoderModel, full-name regexes
UMT5_KEYS = (
    (r"token_embedding\.weight", ("shared.weight", "encoder.embed_tokens.weight")),
    (r"blocks\.(\d+)\.attn\.([qkvo])\.weight", (r"encoder.block.\1.layer.0.SelfAttention.\2.weight",)),
    (r"blocks\.(\d+)\.pos_embedding\.embedding\.weight",
     (r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias.weight",)),
    (r"blocks\.(\d+)\.norm1\.weight", (r"encoder.block.\1.layer.0.layer_norm.weight",)),
    (r"blocks\.(\d+)\.ffn\.gate\.0\.weight", (r"encoder.block.\1.layer.1.DenseReluDense.wi_0.weight",)),
    (r"blocks\.(\d+)\.ffn\.fc1\.weight", (r"encoder.block.\1.layer.1.DenseReluDense.wi_1.weight",)),
    (r"blocks\.(\d+)\.ffn\.fc2\.weight", (r"encoder.block.\1.layer.1.DenseReluDense.wo.weight",)),
    (r"blocks\.(\d+)\.norm2\.weight", (r"encoder.block.\1.layer.1.layer_norm.weight",)),
    (r"norm\.weight", ("encoder.final_layer_norm.weight",)),
)

# inside a 2.2 VAE residual block: Wan's nn.Sequential indices -> diffusers' WanResidualBlock names
VAE_RESIDUAL = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.",
                "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}
VAE22_BLOCK = re.compile(r"(encoder|decoder)\.(downsamples|upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.+)")


# ---- detection ---------------------------------------------------------------------------------
def is_native_file(path: str, key: str, file_name: str) -> bool:
    """True for Wan's own .pth/.pt file. Wan's folder where the file in it is meant is an error that
    names the file (read as a diffusers folder, it would fail on widths that say nothing of the mix-up)."""
    if os.path.isdir(path) and native_transformer_config(path) is not None:
        raise ModelLoadError(f"{key}: '{path}' is Wan's own folder; set {key} to the file in it: "
                             f"{os.path.join(path, file_name)}")
    return os.path.isfile(path) and path.endswith(NATIVE_FILE_SUFFIXES)


def native_transformer_config(folder: str) -> dict[str, Any] | None:
    """Wan's own config.json in `folder` as a dict, or None when `folder` is no folder in Wan's format
    (a diffusers folder names `num_attention_heads`; Wan's `WanModel` names `dim`, `num_heads`, ...)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return config if all(k in config for k in NATIVE_CONFIG_KEYS) else None


# ---- reading ---------------------------------------------------------------------------------
def _transformer_shards(folder: str, key: str) -> list[str]:
    index = os.path.join(folder, f"{TRANSFORMER_WEIGHTS}.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        absent = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
        if absent:
            raise ModelLoadError(f"{key}: '{index}' lists shards that are not in '{folder}': {absent}")
        return [os.path.join(folder, name) for name in files]
    files = sorted(glob.glob(os.path.join(folder, f"{TRANSFORMER_WEIGHTS}*.safetensors")))
    if not files:
        raise ModelLoadError(f"{key}: '{folder}' has Wan's config.json but no {TRANSFORMER_WEIGHTS}*.safetensors")
    return files


def _owned(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy in `dtype` in torch's own (aligned) memory: safetensors hands out tensors at unaligned
    addresses and mmap'd .pth tensors live in the file, where CPU kernels may round differently."""
    return tensor.to(dtype) if tensor.dtype != dtype else tensor.clone()


def _read_safetensors(files: Iterable[str], key: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # tensor by tensor: the bf16 file and its fp32 copy are never both whole
                    state[name] = _owned(f.get_tensor(name), dtype)
        except Exception as e:  # name the file; safetensors' message says what is wrong with it
            raise ModelLoadError(f"{key}: could not read '{path}' as safetensors: {e}") from e
    return state


def _read_pth(path: str, key: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # name the file; torch's message says what is wrong with it
        raise ModelLoadError(f"{key}: could not read '{path}' as a state dict: {e}") from e
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ModelLoadError(f"{key}: '{path}' does not hold a plain state dict of tensors")
    return {name: _owned(tensor, dtype) for name, tensor in state.items()}


# ---- key mappings ------------------------------------------------------------------------------
def _vae22_block_key(name: str) -> str:
    """`encoder.downsamples.i.downsamples.j.residual.2.weight` -> `encoder.down_blocks.i.resnets.j.conv1.weight`,
    the block's final Resample -> `down_blocks.i.downsampler` (decoder: `up_blocks.i.upsampler`)."""
    match = VAE22_BLOCK.fullmatch(name)
    if match is None:
        return name
    part, _, block, layer, rest = match.groups()
    blocks, sampler = ("down_blocks", "downsampler") if part == "encoder" else ("up_blocks", "upsampler")
    if rest.startswith(("resample.", "time_conv.")):
        return f"{part}.{blocks}.{block}.{sampler}.{rest}"
    for old, new in VAE_RESIDUAL.items():
        if rest.startswith(old):
            return f"{part}.{blocks}.{block}.resnets.{layer}.{new}{rest[len(old):]}"
    return name  # unknown: reported as unexpected by the strict load


def umt5_to_transformers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        for pattern, targets in UMT5_KEYS:
            if re.fullmatch(pattern, name):
                out.update({re.sub(pattern, t, name): tensor for t in targets})
                break
        else:
            out[name] = tensor  # unknown: reported as unexpected by the strict load
    return out


# ---- strict loading ----------------------------------------------------------------------------
def load_strict(build: Callable[[], M], state: Mapping[str, torch.Tensor], key: str, path: str, described_by: str) -> M:
    """`build()` on the meta device, then every tensor of `state` assigned by name; any missing,
    unexpected or differently shaped tensor is an error naming the key, both shapes and the file."""
    from accelerate import init_empty_weights

    with init_empty_weights():  # buffers (rope tables) stay real; parameters come from `state`
        model = build()
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [f"{k}: file {tuple(state[k].shape)} vs model {expected[k]}"
              for k in sorted(set(expected) & set(state)) if tuple(state[k].shape) != expected[k]]
    if missing or unexpected or shapes:
        raise ModelLoadError(
            f"{key}: '{path}' does not fit the {type(model).__name__} {described_by}: "
            + "; ".join(f"{what} {items[:5]}{'...' if len(items) > 5 else ''}" for what, items in
                        (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)) if items))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


# ---- the three parts ---------------------------------------------------------------------------
def diffusers_transformer_config(native: Mapping[str, Any], size_wan: Mapping[str, Any], key: str,
                                 folder: str) -> dict[str, Any]:
    """WanTransformer3DModel kwargs: what Wan's config.json states, the rest (patch size, text width,
    q/k norm, rope table length: fixed in Wan's code, not saved) from the size table."""
    heads = native["num_heads"]
    if native["dim"] % heads:
        raise ModelLoadError(f"{key}: '{folder}/config.json' has dim {native['dim']}, not a multiple of "
                             f"num_heads {heads}")
    config = dict(size_wan)
    config.update(num_attention_heads=heads, attention_head_dim=native["dim"] // heads,
                  in_channels=native["in_dim"], out_channels=native.get("out_dim", native["in_dim"]),
                  num_layers=native["num_layers"],
                  **{k: native[k] for k in ("ffn_dim", "freq_dim", "eps") if k in native})
    return config


def load_native_transformer(folder: str, native: Mapping[str, Any], size: ModelSize, key: str
                            ) -> "WanTransformer3DModel":
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    config = diffusers_transformer_config(native, size.wan, key, folder)
    state = _read_safetensors(_transformer_shards(folder, key), key, torch.float32)
    state = convert_wan_transformer_to_diffusers(state)
    model = load_strict(lambda: WanTransformer3DModel(**config), state, key, folder,
                        "that Wan's config.json describes (with the size table's patch size and text width)")
    log.info("%s: loaded Wan's native transformer (%s) from %s", key, native.get("model_type", "?"), folder)
    return model


def load_native_vae(path: str, size: ModelSize, key: str, dtype: torch.dtype) -> "AutoencoderKLWan":
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    state = {_vae22_block_key(k): v for k, v in _read_pth(path, key, dtype).items()}
    model = load_strict(lambda: AutoencoderKLWan(**size.vae), convert_wan_vae_to_diffusers(state), key, path,
                        "of model.size's entry in models/sizes.py")
    log.info("%s: loaded Wan's native VAE from %s (latent statistics from the size table)", key, path)
    return model


def native_tokenizer_folder(path: str, key: str) -> str:
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), TOKENIZER_SUBFOLDER)
    if not os.path.isdir(folder):
        raise ModelLoadError(f"{key}: '{path}' is Wan's native umT5 file; its tokenizer is expected in "
                             f"'{folder}' (Wan2.2-TI2V-5B ships it there) and that folder does not exist")
    return folder


def load_native_umt5(path: str, size: ModelSize, key: str, dtype: torch.dtype) -> "UMT5EncoderModel":
    from transformers import UMT5Config, UMT5EncoderModel

    state = umt5_to_transformers(_read_pth(path, key, dtype))
    model = load_strict(lambda: UMT5EncoderModel(UMT5Config(**size.text_encoder)), state, key, path,
                        "of model.size's entry in models/sizes.py")
    log.info("%s: loaded Wan's native umT5 encoder from %s", key, path)
    return model
