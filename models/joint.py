"""One Mixture-of-Transformers layer: video (a diffusers `WanTransformerBlock`), action and
understanding tokens share one attention call (docs/architecture.md, "One layer, three streams").

The Wan block's own modules are used as they are (attn1.to_q/k/v, norm_q/k, to_out,
attn2, ffn, scale_shift_table); only the order of calls is ours, so that the
self-attention can span the three streams.
"""
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from models.experts import ExpertBlock

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

try:  # optional: used on GPU in half precision when there is no padding mask
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q, k, v [B, S, H, hd]; mask None or bool [B, 1, 1, S] (True: attend). -> [B, S, H * hd]."""
    if flash_attn_func is not None and mask is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return flash_attn_func(q, k, v).flatten(2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, S, H, hd] by Wan's rope tables [1, S, 1, hd] (in fp32)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2].float(), sin[..., 1::2].float()
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


def _modulate(norm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, shift: torch.Tensor,
              scale: torch.Tensor) -> torch.Tensor:
    # Wan keeps the norm and modulation in fp32, then returns to the stream's dtype
    return (norm(x.float()) * (1 + scale) + shift).to(x.dtype)


def joint_layer(block: "WanTransformerBlock", act: ExpertBlock, und: ExpertBlock, v: torch.Tensor, a: torch.Tensor,
                u: torch.Tensor, mod_v: torch.Tensor, mod_a: torch.Tensor, text: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None, heads: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v [B, Sv, Dv], a [B, Sa, Da], u [B, Su, Du]; mod_v [B, 6, Dv] and mod_a [B, 6, Da] are the
    time projections; text [B, Lt, Dv]; rope (cos, sin) for the video tokens."""
    sh_v, sc_v, g_v, csh_v, csc_v, cg_v = (block.scale_shift_table + mod_v.float()).chunk(6, dim=1)
    sh_a, sc_a, g_a, csh_a, csc_a, cg_a = (act.modulation + mod_a.float()).chunk(6, dim=1)

    # 1. one attention over [video | action | und]; RoPE on the video part only
    nv = _modulate(block.norm1, v, sh_v, sc_v)
    attn = block.attn1
    qv, kv, vv = attn.norm_q(attn.to_q(nv)), attn.norm_k(attn.to_k(nv)), attn.to_v(nv)
    qv, kv, vv = (t.unflatten(2, (heads, -1)) for t in (qv, kv, vv))
    qv, kv = apply_rope(qv, *rope), apply_rope(kv, *rope)
    qa, ka, va = (t.unflatten(2, (heads, -1)) for t in act.qkv(_modulate(act.norm1, a, sh_a, sc_a)))
    qu, ku, vu = (t.unflatten(2, (heads, -1)) for t in und.qkv(und.norm1(u)))
    dtype = qv.dtype
    out = attention(torch.cat([qv, qa.to(dtype), qu.to(dtype)], 1), torch.cat([kv, ka.to(dtype), ku.to(dtype)], 1),
                    torch.cat([vv, va.to(dtype), vu.to(dtype)], 1), mask)
    ov, oa, ou = out.split([v.shape[1], a.shape[1], u.shape[1]], dim=1)
    v = (v.float() + attn.to_out[0](ov.to(v.dtype)) * g_v).to(v.dtype)
    a = (a.float() + act.to_out(oa.to(a.dtype)) * g_a).to(a.dtype)
    u = u + und.to_out(ou.to(u.dtype))

    # 2. video tokens cross-attend to the text (ungated, as in Wan)
    v = v + block.attn2(block.norm2(v.float()).to(v.dtype), text, None, None)

    # 3. each stream's FFN: video and action modulated and gated, und plain
    v = (v.float() + block.ffn(_modulate(block.norm3, v, csh_v, csc_v)).float() * cg_v).to(v.dtype)
    a = (a.float() + act.ffn(_modulate(act.norm2, a, csh_a, csc_a)).float() * cg_a).to(a.dtype)
    u = u + und.ffn(und.norm2(u))
    return v, a, u
