"""Named model sizes, one table (DiT style): `model.size` picks an entry by name.

Each size fixes the architecture of every part so that they fit together: the
Wan transformer's `in_channels` is the VAE's `z_dim`, its `text_dim` the text
encoder's `d_model`, and the understanding expert's input width the VLM's hidden
size. `motus` is the published Motus model (Wan2.2-TI2V-5B + Qwen3-VL-2B +
umT5-XXL); `tiny` keeps the same structure with small dims so a training step
takes seconds on a CPU; `small` sits in between for single-GPU experiments.
"""
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
    def num_layers(self):
        return self.wan["num_layers"]


def _wan(num_layers, heads, head_dim, in_channels, text_dim, ffn_dim):
    return dict(patch_size=[1, 2, 2], num_attention_heads=heads, attention_head_dim=head_dim,
                in_channels=in_channels, out_channels=in_channels, text_dim=text_dim, freq_dim=256,
                ffn_dim=ffn_dim, num_layers=num_layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def _vae(base_dim, decoder_base_dim, z_dim, dim_mult=(1, 2, 4, 4), temporal=(False, True, True)):
    # Wan2.2's structure (residual blocks, 2x2 patchify, then one 2x spatial downsampling per stage
    # after the first; two of them also halve time). latents_mean/std are placeholders for the
    # published ones (real folders carry them; tiny_assets measures them).
    return dict(base_dim=base_dim, decoder_base_dim=decoder_base_dim, z_dim=z_dim, dim_mult=list(dim_mult),
                num_res_blocks=2, temperal_downsample=list(temporal), is_residual=True,
                in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4,
                scale_factor_spatial=2 ** len(dim_mult), latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)


def _umt5(vocab_size, d_model, d_ff, num_layers, num_heads, d_kv):
    return dict(vocab_size=vocab_size, d_model=d_model, d_ff=d_ff, num_layers=num_layers,
                num_heads=num_heads, d_kv=d_kv, feed_forward_proj="gated-gelu",
                relative_attention_num_buckets=32, pad_token_id=0, eos_token_id=1)


def _qwen_text(vocab_size, hidden, layers, heads, kv_heads, head_dim, intermediate, theta):
    return dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                intermediate_size=intermediate, max_position_embeddings=262144,
                rope_parameters=dict(rope_type="default", rope_theta=theta, mrope_section=[24, 20, 20],
                                     mrope_interleaved=True))


def _qwen_vision(depth, hidden, intermediate, heads, out_hidden, deepstack):
    return dict(depth=depth, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads,
                patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=out_hidden,
                num_position_embeddings=2304, deepstack_visual_indexes=deepstack)


# Wan2.2-TI2V-5B + Wan2.2 VAE + umT5-XXL + Qwen3-VL-2B-Instruct, as published (docs/architecture.md has every part's shapes and counts).
MOTUS = ModelSize(
    wan=_wan(30, 24, 128, 48, 4096, 14336),
    vae=_vae(160, 256, 48),
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


def get_size(name):
    if name not in SIZES:
        raise ValueError(f"model.size is '{name}'; expected one of {', '.join(SIZES)}")
    return SIZES[name]
