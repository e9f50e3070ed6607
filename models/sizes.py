"""Named model sizes, one table (DiT style): `model.size` picks an entry by name.

Each size fixes the architecture of every part so that they fit together: the
Wan transformer's `in_channels` is the VAE's `z_dim`, its `text_dim` the text
encoder's `d_model`, and the understanding expert's input width the VLM's hidden
size. `motus` is the published Motus model (Wan2.2-TI2V-5B + Qwen3-VL-2B +
umT5-XXL); `tiny` keeps the same structure with small dims so a training step
takes seconds on a CPU; `small` sits in between for single-GPU experiments.
"""
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Dict


@dataclass(frozen=True)
class ModelSize:
    wan: Dict[str, Any]
    """Keyword arguments of diffusers `WanTransformer3DModel` (used when no checkpoint is loaded)."""
    vae: Dict[str, Any]
    """Keyword arguments of diffusers `AutoencoderKLWan`."""
    text_encoder: Dict[str, Any]
    """Keyword arguments of transformers `UMT5Config` (encoder only)."""
    text_len: int
    """Text tokens fed to the cross-attention (Wan pads umT5 embeddings to 512)."""
    vlm_text: Dict[str, Any]
    """`Qwen3VLTextConfig` keyword arguments."""
    vlm_vision: Dict[str, Any]
    """`Qwen3VLVisionConfig` keyword arguments."""
    action_hidden: int
    und_hidden: int
    vlm_extra: Dict[str, Any] = field(default_factory=dict)
    """Top-level `Qwen3VLConfig` keyword arguments (token ids, tied embeddings)."""

    @property
    def num_layers(self) -> int:
        return self.wan["num_layers"]


def _wan(num_layers: int, heads: int, head_dim: int, in_channels: int, text_dim: int, ffn_dim: int) -> dict[str, Any]:
    return dict(patch_size=[1, 2, 2], num_attention_heads=heads, attention_head_dim=head_dim,
                in_channels=in_channels, out_channels=in_channels, text_dim=text_dim, freq_dim=256,
                ffn_dim=ffn_dim, num_layers=num_layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def _vae(base_dim: int, decoder_base_dim: int, z_dim: int, dim_mult: Sequence[int] = (1, 2, 4, 4),
         temporal: Sequence[bool] = (False, True, True), latents_mean: Sequence[float] | None = None,
         latents_std: Sequence[float] | None = None) -> dict[str, Any]:
    # Wan2.2's structure (residual blocks, 2x2 patchify, then one 2x spatial downsampling per stage
    # after the first; two of them also halve time). Without latents_mean/std: placeholders
    # (diffusers folders carry their own; tiny_assets measures them).
    return dict(base_dim=base_dim, decoder_base_dim=decoder_base_dim, z_dim=z_dim, dim_mult=list(dim_mult),
                num_res_blocks=2, temperal_downsample=list(temporal), is_residual=True,
                in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4,
                scale_factor_spatial=2 ** len(dim_mult), latents_mean=list(latents_mean or [0.0] * z_dim),
                latents_std=list(latents_std or [1.0] * z_dim))


# The Wan2.2 VAE's published latent statistics: Wan's code (Wan2_2_VAE) hard-codes them, its
# Wan2.2_VAE.pth does not carry them, so a native VAE file takes them from here.
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667)
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)


def _umt5(vocab_size: int, d_model: int, d_ff: int, num_layers: int, num_heads: int, d_kv: int) -> dict[str, Any]:
    return dict(vocab_size=vocab_size, d_model=d_model, d_ff=d_ff, num_layers=num_layers,
                num_heads=num_heads, d_kv=d_kv, feed_forward_proj="gated-gelu",
                relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1)


def _qwen_text(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
               theta: float) -> dict[str, Any]:
    return dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                intermediate_size=intermediate, max_position_embeddings=262144,
                rope_parameters=dict(rope_type="default", rope_theta=theta, mrope_section=[24, 20, 20],
                                     mrope_interleaved=True))


def _qwen_vision(depth: int, hidden: int, intermediate: int, heads: int, out_hidden: int,
                 deepstack: list[int]) -> dict[str, Any]:
    return dict(depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads,
                patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=out_hidden,
                num_position_embeddings=2304, deepstack_visual_indexes=deepstack)


# Wan2.2-TI2V-5B + Wan2.2 VAE + umT5-XXL + Qwen3-VL-2B-Instruct, as published (docs/architecture.md has every part's shapes and counts).
MOTUS = ModelSize(
    wan=_wan(30, 24, 128, 48, 4096, 14336),
    vae=_vae(160, 256, 48, latents_mean=WAN22_LATENTS_MEAN, latents_std=WAN22_LATENTS_STD),
    text_encoder=_umt5(256384, 4096, 10240, 24, 64, 64),
    text_len=512,
    vlm_text=_qwen_text(151936, 2048, 28, 16, 8, 128, 6144, 5_000_000),
    vlm_vision=_qwen_vision(24, 1024, 4096, 16, 2048, [5, 11, 17]),
    vlm_extra=dict(tie_word_embeddings=True),
    action_hidden=1024,
    und_hidden=512,
)

# Tiny parts share one locally trained tokenizer (models/tiny_assets.py): its vocabulary
# size and the Qwen special-token ids below are fixed by that tokenizer.
TINY_VOCAB = 512
TINY = ModelSize(
    wan=_wan(2, 2, 32, 8, 32, 128),
    # one stage fewer than Wan2.2 (8x instead of 16x): a 64x64 frame keeps an 8x8 latent grid,
    # 16 video tokens per latent frame, enough to see the synthetic squares move
    vae=_vae(8, 8, 8, dim_mult=(1, 2, 2), temporal=(True, True)),
    text_encoder=_umt5(TINY_VOCAB, 32, 64, 1, 2, 16),
    text_len=16,
    # mrope sections count rotary pairs of the 16-wide heads: 2 + 3 + 3 = 8.
    vlm_text=dict(_qwen_text(TINY_VOCAB, 32, 1, 2, 1, 16, 64, 10000.0),
                  rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                       mrope_interleaved=True)),
    vlm_vision=dict(_qwen_vision(1, 32, 64, 2, 32, [0]), num_position_embeddings=64),
    vlm_extra=dict(tie_word_embeddings=True),
    action_hidden=64,
    und_hidden=32,
)

# One GPU: a 12-layer, 1024-wide video expert over the Wan2.2 VAE, a 0.6B-class text stack.
SMALL = replace(
    MOTUS,
    wan=_wan(12, 8, 128, 48, 4096, 4096),
    action_hidden=512,
    und_hidden=256,
)

SIZES = {"tiny": TINY, "small": SMALL, "motus": MOTUS}


def get_size(name: str) -> ModelSize:
    if name not in SIZES:
        raise ValueError(f"model.size is '{name}'; expected one of {', '.join(SIZES)}")
    return SIZES[name]
