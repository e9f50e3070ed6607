"""Load pretrained parts from local diffusers/transformers folders or Wan2.2's own files, or fail
saying why.

A folder may be the part itself (config.json + weights) or a diffusers pipeline root
(model_index.json) with the part in its usual subfolder (transformer/, vae/,
text_encoder/ + tokenizer/). Wan's own files (models/native_wan.py) are told apart by Wan's
config.json (transformer) or by being a .pth file (VAE, umT5). A path that does not load is
always an error naming the path and what was missing; a missing weight is never left at random init.
"""
import glob
import inspect
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from models import native_wan
from models.serialization import ModelLoadError
from models.sizes import ModelSize

if TYPE_CHECKING:  # imported where used: reading a recipe does not load them
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import PreTrainedTokenizerBase, UMT5EncoderModel

log = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
M = TypeVar("M", bound=torch.nn.Module)  # a diffusers or transformers model


class FolderLoader(Protocol):
    """A bound `from_pretrained` of a transformers Auto class (AutoTokenizer, AutoImageProcessor)."""
    __self__: type

    def __call__(self, folder: str, /, *, local_files_only: bool) -> Any: ...


def resolve_folder(path: str, key: str, subfolder: str) -> str:
    """The folder holding the part: `path`, or `path/subfolder` for a pipeline root."""
    if not os.path.exists(path):
        raise ModelLoadError(f"{key}: '{path}' does not exist (expected a local folder saved with "
                             "save_pretrained or one of Wan2.2's own files; downloads are not attempted)")
    if not os.path.isdir(path):
        raise ModelLoadError(f"{key}: '{path}' is a file; expected a folder with config.json and weights "
                             f"(files accepted: Wan's own {' or '.join(native_wan.NATIVE_FILE_SUFFIXES)} "
                             "for model.wan.vae_path and text_encoder_path)")
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(os.path.join(path, subfolder)):
        path = os.path.join(path, subfolder)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{key}: '{path}' has no config.json (nor a '{subfolder}/' subfolder with one)")
    if not any(glob.glob(os.path.join(path, p)) for p in WEIGHT_PATTERNS):
        raise ModelLoadError(f"{key}: '{path}' has a config.json but no weights (*.safetensors or *.bin)")
    return path


def read_part_config(cls: type[torch.nn.Module], path: str, key: str, subfolder: str) -> dict[str, Any]:
    """The config of a diffusers/transformers folder as a dict (a diffusers class's defaults under
    what the folder states), without reading a weight: checks run on it before anything loads."""
    folder = resolve_folder(path, key, subfolder)
    try:
        if hasattr(cls, "load_config"):  # diffusers
            defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                        if p.default is not inspect.Parameter.empty}
            return {**defaults, **cls.load_config(folder, local_files_only=True)}
        return cls.config_class.from_pretrained(folder, local_files_only=True).to_dict()
    except Exception as e:  # name the folder; the library's message says what broke
        raise ModelLoadError(f"{key}: could not read the config of {cls.__name__} in '{folder}': {e}") from e


def load_part(cls: type[M], path: str, key: str, subfolder: str, **kwargs: Any) -> M:
    """`cls.from_pretrained` on a local folder; missing or mismatched weights are an error."""
    folder = resolve_folder(path, key, subfolder)
    try:
        model, info = cls.from_pretrained(folder, output_loading_info=True, local_files_only=True, **kwargs)
    except Exception as e:  # name the folder and the part; the library's message says what broke
        raise ModelLoadError(f"{key}: could not load {cls.__name__} from '{folder}': {e}") from e
    missing = list(info.get("missing_keys", []))
    mismatched = list(info.get("mismatched_keys", []))
    if missing or mismatched:
        raise ModelLoadError(f"{key}: '{folder}' lacks weights of {cls.__name__}: missing {missing[:5]}, "
                             f"mismatched {mismatched[:5]} (they would be left at random init)")
    log.info("%s: loaded %s from %s", key, cls.__name__, folder)
    return model


def load_tokenizer_or_processor(loader: FolderLoader, path: str, key: str, subfolders: Sequence[str]) -> Any:
    """A tokenizer/processor from `path` or one of its `subfolders` (pipeline layout)."""
    candidates = [path] + [os.path.join(path, s) for s in subfolders]
    errors = []
    for folder in candidates:
        if not os.path.isdir(folder):
            continue
        try:
            return loader(folder, local_files_only=True)
        except Exception as e:  # try the next layout, report all of them if none works
            errors.append(f"{folder}: {e}")
    raise ModelLoadError(f"{key}: no loadable {loader.__self__.__name__} in '{path}' "
                         f"(looked in {', '.join(candidates)}): {'; '.join(errors) or 'no such folder'}")


def wan_transformer_config(path: str, size: ModelSize, key: str) -> dict[str, Any]:
    """WanTransformer3DModel's kwargs for what `path` holds (see load_wan_transformer), weights unread."""
    from diffusers import WanTransformer3DModel

    native = native_wan.native_transformer_config(path)
    if native is not None:
        return native_wan.diffusers_transformer_config(native, size.wan, key, path)
    return read_part_config(WanTransformer3DModel, path, key, "transformer")


def wan_vae_config(path: str, size: ModelSize, key: str) -> dict[str, Any]:
    """AutoencoderKLWan's kwargs for what `path` holds; Wan's .pth has none: the size table's."""
    from diffusers import AutoencoderKLWan

    if native_wan.is_native_file(path, key, native_wan.VAE_FILE):
        return dict(size.vae)
    return read_part_config(AutoencoderKLWan, path, key, "vae")


def text_encoder_config(path: str, size: ModelSize, key: str) -> dict[str, Any]:
    """UMT5Config as a dict for what `path` holds; Wan's .pth has none: the size table's."""
    from transformers import UMT5EncoderModel

    if native_wan.is_native_file(path, key, native_wan.UMT5_FILE):
        return dict(size.text_encoder)
    return read_part_config(UMT5EncoderModel, path, key, "text_encoder")


def load_wan_transformer(path: str, size: ModelSize, key: str) -> "WanTransformer3DModel":
    """WanTransformer3DModel from a diffusers folder or from Wan's own (config.json with `dim`, ...)."""
    from diffusers import WanTransformer3DModel

    native = native_wan.native_transformer_config(path)
    if native is not None:
        return native_wan.load_native_transformer(path, native, size, key)
    return load_part(WanTransformer3DModel, path, key, "transformer")


def load_wan_vae(path: str, size: ModelSize, key: str, dtype: torch.dtype) -> "AutoencoderKLWan":
    """AutoencoderKLWan from a diffusers folder or from Wan's `Wan2.2_VAE.pth`."""
    from diffusers import AutoencoderKLWan

    if native_wan.is_native_file(path, key, native_wan.VAE_FILE):
        return native_wan.load_native_vae(path, size, key, dtype)
    return load_part(AutoencoderKLWan, path, key, "vae", torch_dtype=dtype)


def load_text_encoder(path: str, size: ModelSize, key: str, dtype: torch.dtype
                      ) -> tuple["UMT5EncoderModel", "PreTrainedTokenizerBase"]:
    """(UMT5EncoderModel, tokenizer) from a transformers folder (tokenizer inside or in tokenizer/)
    or from Wan's `models_t5_umt5-xxl-enc-bf16.pth` (tokenizer in google/umt5-xxl/ beside it)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    if native_wan.is_native_file(path, key, native_wan.UMT5_FILE):
        model = native_wan.load_native_umt5(path, size, key, dtype)
        tokenizer_folder, subfolders = native_wan.native_tokenizer_folder(path, key), []
    else:
        model = load_part(UMT5EncoderModel, path, key, "text_encoder", dtype=dtype)
        tokenizer_folder, subfolders = path, ["tokenizer"]
    return model, load_tokenizer_or_processor(AutoTokenizer.from_pretrained, tokenizer_folder, key, subfolders)
