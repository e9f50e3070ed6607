"""`build_world_model(cfg)`: the trainable WorldModel and the FrozenEncoders, from the config.

Paths in the config load local folders or Wan2.2's own files (models/loading.py); a null path
builds the part with random init from the size table, and says so in the log.

Only the frozen parts the run calls are built (`frozen_parts_for_training`): a latent cache
(`dataset.cache_dir`, data/cache.py) provides video latents, text embeddings and VLM features, so
training from one loads neither umT5 nor Qwen3-VL into host memory (14.5 GiB per process at full
size: `host_ram_gib_per_process` of models/memory_model.py). The VAE is always built: validation pictures
decode latents with it. Commands that encode raw data (building the cache, inference) ask for
`ALL_FROZEN_PARTS`.
"""
import logging
from collections.abc import Collection, Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, OmegaConf

from models import tiny_assets
from models.encoders import FROZEN_OUTPUTS, PART_NAMES, FrozenEncoders
from models.loading import (load_part, load_text_encoder, load_tokenizer_or_processor, load_wan_transformer,
                            load_wan_vae, read_part_config, text_encoder_config, wan_transformer_config,
                            wan_vae_config)
from models.serialization import ModelLoadError
from models.sizes import ModelSize, get_size
from models.world_model import WorldModel

if TYPE_CHECKING:  # imported where used: reading a recipe does not load them
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import (BaseImageProcessor, PreTrainedTokenizerBase, Qwen3VLForConditionalGeneration,
                              UMT5EncoderModel)

log = logging.getLogger(__name__)

ALL_FROZEN_PARTS = tuple(FROZEN_OUTPUTS)
OUTPUT_NAMES = {"video_latents": "video latents", "text_embeds": "text embeddings", "vlm_features": "VLM features"}
CACHED_INPUTS = frozenset(FROZEN_OUTPUTS.values())


def provided_inputs(cfg: DictConfig) -> set[str]:
    """Inputs the data gives ready-made: a latent cache holds video latents, text embeddings and VLM
    features (data/cache.py); raw data provides none."""
    return set(CACHED_INPUTS) if cfg.dataset.cache_dir else set()


def frozen_parts_needed(provided: Container[str]) -> tuple[str, ...]:
    """The frozen parts a training run calls when the data provides the inputs `provided`: those whose
    outputs it lacks, and the VAE always (it decodes validation pictures)."""
    return tuple(k for k, out in FROZEN_OUTPUTS.items() if k == "vae" or out not in provided)


def frozen_parts_for_training(cfg: DictConfig) -> tuple[str, ...]:
    return frozen_parts_needed(provided_inputs(cfg))


def skipped_parts(cfg: DictConfig, frozen_parts: Container[str]) -> dict[str, str]:
    """{part: why it is not built} for the frozen parts outside `frozen_parts`."""
    provided = provided_inputs(cfg)
    return {part: (f"dataset.cache_dir provides {OUTPUT_NAMES[out]}" if out in provided
                   else "the caller did not ask for it")
            for part, out in FROZEN_OUTPUTS.items() if part not in frozen_parts}


def _check_frozen_parts(frozen_parts: Collection[str]) -> None:
    if set(frozen_parts) - set(FROZEN_OUTPUTS) or "vae" not in frozen_parts:
        raise ValueError(f"frozen_parts is {tuple(frozen_parts)}; expected a subset of {ALL_FROZEN_PARTS} that "
                         "holds 'vae' (the model's latent geometry and picture decoding need it)")


def _and(words: Iterable[str]) -> str:
    return " and ".join(words)


def _log_skipped(cfg: DictConfig, skipped: Mapping[str, str]) -> None:
    """One line: what was not loaded and why (with a cache: which of its inputs replace them)."""
    if not skipped:
        return
    cached = [p for p in skipped if FROZEN_OUTPUTS[p] in provided_inputs(cfg)]
    if cached == list(skipped):
        log.info("dataset.cache_dir provides %s: %s %s not loaded",
                 _and(OUTPUT_NAMES[FROZEN_OUTPUTS[p]] for p in cached), _and(PART_NAMES[p] for p in cached),
                 "is" if len(cached) == 1 else "are")
    else:
        log.info("not loaded: %s", "; ".join(f"{PART_NAMES[p]} ({why})" for p, why in skipped.items()))


def vae_compression(vae_config: Mapping[str, Any]) -> tuple[int, int]:
    """(temporal, spatial) compression of an AutoencoderKLWan config: frames per latent frame after
    the first, and pixels per latent cell (2x per downsampling stage, times the patchify)."""
    spatial = 2 ** (len(vae_config["dim_mult"]) - 1) * (vae_config["patch_size"] or 1)
    return 2 ** sum(bool(t) for t in vae_config["temperal_downsample"]), spatial


def check_geometry(cfg: DictConfig, vae_config: Mapping[str, Any], wan_config: Mapping[str, Any]) -> None:
    """Frames and pixels must fit the VAE's compression and Wan's patches."""
    c, (temporal, spatial) = cfg.common, vae_compression(vae_config)
    if c.num_video_frames % temporal:
        raise ValueError(f"common.num_video_frames is {c.num_video_frames}; the VAE needs a multiple of "
                         f"{temporal} (1 condition frame + {temporal}k frames)")
    step = spatial * wan_config["patch_size"][-1]
    if c.video_height % step or c.video_width % step:
        raise ValueError(f"common.video_height/width are {c.video_height}x{c.video_width}; both must be "
                         f"multiples of {step} (VAE x{spatial}, Wan patch {wan_config['patch_size'][-1]})")


def model_spec(cfg: DictConfig, size: ModelSize, wan_config: Mapping[str, Any],
               vae_config: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-able architecture description WorldModel is built from (and saved as config.json).
    The one place it is assembled: `build_world_model`, `spec_from_config` and `size_table_model`
    all come here."""
    m = cfg.model
    return {
        "wan": {k: (list(v) if isinstance(v, tuple) else v) for k, v in wan_config.items()
                if not k.startswith("_")},
        "action_hidden": m.action_expert.hidden_size or size.action_hidden,
        "und_hidden": m.und_expert.hidden_size or size.und_hidden,
        "vlm_dim": m.und_expert.vlm.input_dim,  # checked against the VLM's hidden size by _check_fit
        "action_dim": cfg.common.action_dim,
        "state_dim": cfg.common.state_dim,
        "action_chunk_size": cfg.common.action_chunk_size,
        "latent_frames": 1 + cfg.common.num_video_frames // vae_compression(vae_config)[0],
        "model": OmegaConf.to_container(m, resolve=True),
    }


def spec_from_config(cfg: DictConfig) -> dict[str, Any]:
    """The spec `build_world_model` builds for `cfg`, from the parts' config files alone (no weight
    is read): what an export or a converter needs to rebuild the architecture."""
    size = get_size(cfg.model.size)
    wan_config, vae_config, _, _ = part_configs(cfg, size)
    return model_spec(cfg, size, wan_config, vae_config)


def size_table_model(cfg: DictConfig, num_layers: int | None = None) -> WorldModel:
    """The WorldModel of `cfg` from the size table (optionally another depth), with random init:
    build it under `torch.device("meta")` or a FakeTensorMode to count or trace without memory."""
    size = get_size(cfg.model.size)
    wan = dict(size_table_wan(cfg, size), **({"num_layers": num_layers} if num_layers else {}))
    return WorldModel(model_spec(cfg, size, wan, size.vae)).apply_precision()


def _random(what: str, key: str, warn: bool = True) -> None:
    (log.warning if warn else log.info)("%s is null: %s built with RANDOM init from the size table", key, what)


def size_table_wan(cfg: DictConfig, size: ModelSize) -> dict[str, Any]:
    """Wan's kwargs for a video expert built fresh: the size table's, at model.wan.num_layers and
    model.wan.num_attention_heads if set (the width stays the size's)."""
    wan_cfg = cfg.model.wan
    depth, heads = wan_cfg.num_layers, wan_cfg.num_attention_heads
    for key, value in (("num_layers", depth), ("num_attention_heads", heads)):
        if value is not None and wan_cfg.checkpoint_path is not None:
            raise ModelLoadError(f"model.wan.{key} is {value} but model.wan.checkpoint_path is set: a checkpoint "
                                 f"has its own; set {key} to null")
        if value is not None and value < 1:
            raise ModelLoadError(f"model.wan.{key} must be at least 1, got {value}")
    wan = dict(size.wan, num_layers=depth or size.num_layers)
    if heads is not None:
        width = size.wan["num_attention_heads"] * size.wan["attention_head_dim"]
        # Wan's RoPE gives each spatial axis 2 * (head_dim // 6) channels: a head needs at least 6
        if width % heads or width // heads < 6 or (width // heads) % 2:
            raise ModelLoadError(f"model.wan.num_attention_heads is {heads}: the {cfg.model.size} size's width "
                                 f"{width} must split into heads of an even size of at least 6 "
                                 f"(RoPE rotates channel pairs over three axes)")
        wan.update(num_attention_heads=heads, attention_head_dim=width // heads)
    return wan


def build_video_expert(cfg: DictConfig, size: ModelSize) -> tuple["WanTransformer3DModel | None", dict[str, Any]]:
    path = cfg.model.wan.checkpoint_path
    if path is None:
        _random("the Wan video transformer", "model.wan.checkpoint_path", warn=cfg.model.size != "tiny")
        return None, size_table_wan(cfg, size)
    size_table_wan(cfg, size)  # refuses a depth beside a checkpoint
    video = load_wan_transformer(path, size, "model.wan.checkpoint_path")
    return video, dict(video.config)


def build_encoders(cfg: DictConfig, size: ModelSize, frozen_parts: Iterable[str] | None = None) -> FrozenEncoders:
    """FrozenEncoders on the CPU holding `frozen_parts` (None: `frozen_parts_for_training(cfg)`); the
    others are None, and their encode calls say why."""
    frozen_parts = frozen_parts_for_training(cfg) if frozen_parts is None else tuple(frozen_parts)
    _check_frozen_parts(frozen_parts)
    skipped = skipped_parts(cfg, frozen_parts)
    _log_skipped(cfg, skipped)
    # frozen parts are loaded straight in their compute dtype: umT5-XXL alone is 23 GB in fp32
    dtype = torch.float32 if cfg.model.precision == "fp32" else torch.bfloat16
    # a random-init part seeds its own init: the caller's RNG (the WorldModel's init after this) is
    # the same whichever parts are built
    with torch.random.fork_rng(devices=[]):
        vae = _build_vae(cfg, size, dtype)
        text_encoder, tokenizer = _build_text(cfg, size, dtype) if "text_encoder" in frozen_parts else (None, None)
        vlm, vlm_tokenizer, processor = _build_vlm(cfg, size, dtype) if "vlm" in frozen_parts else (None, None, None)
    return FrozenEncoders(vae, text_encoder, tokenizer, size.text_len, vlm, vlm_tokenizer, processor, dtype,
                          skipped=skipped, text_cache_mb=cfg.model.wan.text_cache_mb).to("cpu")


def _build_vae(cfg: DictConfig, size: ModelSize, dtype: torch.dtype) -> "AutoencoderKLWan":
    if cfg.model.wan.vae_path is None:
        _random("the VAE", "model.wan.vae_path")
        return tiny_assets.build_vae(size)
    return load_wan_vae(cfg.model.wan.vae_path, size, "model.wan.vae_path", dtype)


def _build_text(cfg: DictConfig, size: ModelSize, dtype: torch.dtype
                ) -> tuple["UMT5EncoderModel", "PreTrainedTokenizerBase"]:
    """(umT5 encoder, its tokenizer)."""
    path = cfg.model.wan.text_encoder_path
    if path is None:
        _random("the umT5 text encoder (and a locally trained tokenizer)", "model.wan.text_encoder_path")
        return tiny_assets.build_text_encoder(size), tiny_assets.build_tokenizer()
    return load_text_encoder(path, size, "model.wan.text_encoder_path", dtype)


def _build_vlm(cfg: DictConfig, size: ModelSize, dtype: torch.dtype
               ) -> tuple["Qwen3VLForConditionalGeneration", "PreTrainedTokenizerBase", "BaseImageProcessor"]:
    """(Qwen3-VL, its tokenizer, its image processor)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    path = cfg.model.vlm.checkpoint_path
    if path is None:
        _random("the Qwen3-VL model (and a local tokenizer/image processor)", "model.vlm.checkpoint_path")
        tokenizer = tiny_assets.build_tokenizer()
        return tiny_assets.build_vlm(tokenizer, size), tokenizer, tiny_assets.build_image_processor(size)
    vlm = load_part(Qwen3VLForConditionalGeneration, path, "model.vlm.checkpoint_path", "vlm", dtype=dtype)
    tokenizer = load_tokenizer_or_processor(AutoTokenizer.from_pretrained, path, "model.vlm.checkpoint_path", [])
    processor = load_tokenizer_or_processor(AutoImageProcessor.from_pretrained, path, "model.vlm.checkpoint_path", [])
    return vlm, tokenizer, processor


def part_configs(cfg: DictConfig, size: ModelSize) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """(Wan's kwargs, the VAE's kwargs, the text encoder's width, the VLM's width) that the config's
    paths hold, from their config files alone (the size table's for a null path): no weight is read."""
    from transformers import Qwen3VLForConditionalGeneration

    wan, vlm_path = cfg.model.wan, cfg.model.vlm.checkpoint_path
    fresh = size_table_wan(cfg, size)  # first: refuses a depth beside a checkpoint before reading it
    wan_config = (fresh if wan.checkpoint_path is None
                  else wan_transformer_config(wan.checkpoint_path, size, "model.wan.checkpoint_path"))
    vae_config = dict(size.vae) if wan.vae_path is None else wan_vae_config(wan.vae_path, size, "model.wan.vae_path")
    text_dim = (size.text_encoder["d_model"] if wan.text_encoder_path is None else
                text_encoder_config(wan.text_encoder_path, size, "model.wan.text_encoder_path")["d_model"])
    vlm_dim = (size.vlm_text["hidden_size"] if vlm_path is None else read_part_config(
        Qwen3VLForConditionalGeneration, vlm_path, "model.vlm.checkpoint_path", "vlm")["text_config"]["hidden_size"])
    return wan_config, vae_config, text_dim, vlm_dim


def _check_fit(cfg: DictConfig, wan_config: Mapping[str, Any], z_dim: int, text_dim: int, vlm_dim: int) -> None:
    """The parts must agree on widths: say which key or folder disagrees."""
    checks = [("in_channels", wan_config["in_channels"], "the VAE's z_dim", z_dim),
              ("text_dim", wan_config["text_dim"], "the text encoder's d_model", text_dim)]
    for name, have, what, want in checks:
        if have != want:
            raise ModelLoadError(f"the Wan transformer's {name} is {have} but {what} is {want}: "
                                 "model.wan.checkpoint_path, vae_path and text_encoder_path must belong together")
    if cfg.model.und_expert.vlm.input_dim != vlm_dim:
        raise ModelLoadError(f"model.und_expert.vlm.input_dim is {cfg.model.und_expert.vlm.input_dim} but the "
                             f"VLM's hidden size is {vlm_dim}; set it to {vlm_dim}")


def build_world_model(cfg: DictConfig, frozen_parts: Iterable[str] | None = None) -> tuple[WorldModel, FrozenEncoders]:
    """-> (WorldModel on CPU, every parameter trainable; FrozenEncoders on CPU). `frozen_parts`: the
    names (of ALL_FROZEN_PARTS) to build; None builds what training with `cfg` calls
    (`frozen_parts_for_training`); a command that encodes raw data passes ALL_FROZEN_PARTS. The config
    files of every part are checked either way."""
    size = get_size(cfg.model.size)
    tiny_assets.ensure_tiny_assets(cfg)
    # geometry and widths are checked on the config files, before gigabytes of weights are read
    wan_config, vae_config, text_dim, vlm_dim = part_configs(cfg, size)
    check_geometry(cfg, vae_config, wan_config)
    _check_fit(cfg, wan_config, vae_config["z_dim"], text_dim, vlm_dim)
    video, wan_config = build_video_expert(cfg, size)
    encoders = build_encoders(cfg, size, frozen_parts)
    spec = model_spec(cfg, size, wan_config, encoders.vae.config)
    model = WorldModel(spec, video=video).apply_precision()
    n_train = sum(p.numel() for p in model.parameters())
    log.info("world model %s: %.1fM trainable parameters, precision %s", cfg.model.size, n_train / 1e6,
             cfg.model.precision)
    return model, encoders
