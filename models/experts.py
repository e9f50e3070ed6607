"""The action and understanding experts (docs/architecture.md: "Action expert", "Understanding expert").

Both have one block per Wan block. A block projects its tokens into the Wan head
space with its own q/k/v (the joint attention itself runs in `models/joint.py`),
and owns its output projection and FFN. Module names (`action_expert.layers.N...`)
are what optimizer routing patterns match.
"""
import math

import torch
from diffusers.models.embeddings import get_timestep_embedding
from torch import nn

TIME_FREQ_DIM = 256


def mlp3x_silu(in_dim: int, dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, dim), nn.SiLU(), nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))


ADAPTERS = {"mlp3x_silu": mlp3x_silu}  # VLM features -> understanding-expert width


def sincos_table(length: int, dim: int) -> torch.Tensor:
    """Fixed 1-D sin-cos positions [1, length, dim] (first half sin, second half cos; frequencies
    10000^(-i / (dim / 2)), as Motus's `get_1d_sincos_pos_embed_from_grid`)."""
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float64) / max(dim // 2, 1))
    table = torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(length, 1, dtype=torch.float64)], dim=1)
    return table.float()[None]


class ExpertBlock(nn.Module):
    """norm1 -> q/k/v into the Wan head space (+ RMSNorm on q, k); o back to the expert width;
    norm2 -> FFN. `modulated` adds a `modulation [1, 6, D]` table (AdaLN, as Wan's blocks)."""

    def __init__(self, dim: int, ffn_dim: int, inner_dim: int, eps: float, modulated: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.norm_q = nn.RMSNorm(inner_dim, eps=eps)
        self.norm_k = nn.RMSNorm(inner_dim, eps=eps)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5) if modulated else None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.norm_q(self.to_q(x)), self.norm_k(self.to_k(x)), self.to_v(x)


class ActionExpert(nn.Module):
    """Tokens `[state | noisy chunk | registers]` (fine-tune) or the chunk alone (pretrain),
    modulated by the action noise level; a zero-initialised decoder reads the chunk back."""

    def __init__(self, num_layers: int, dim: int, ffn_mult: int, inner_dim: int, eps: float, action_dim: int,
                 state_dim: int, action_chunk_size: int, num_registers: int, use_state: bool,
                 position_scale: float = 1.0) -> None:
        super().__init__()
        self.use_state = use_state
        self.action_chunk_size = action_chunk_size
        self.state_encoder = mlp3x_silu(state_dim, dim) if use_state else None
        self.action_encoder = mlp3x_silu(action_dim, dim)
        self.registers = nn.Parameter(torch.randn(1, num_registers, dim) * 0.02) if use_state else None
        num_tokens = action_chunk_size + (1 + num_registers if use_state else 0)
        # Motus's table at scale 1. Persistent: a checkpoint's table wins over this recomputed one;
        # Motus's checkpoints hold it rounded to bf16, and that is the function they were trained with.
        self.register_buffer("positions", position_scale * sincos_table(num_tokens, dim))
        self.time_embedder = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.layers = nn.ModuleList(
            ExpertBlock(dim, dim * ffn_mult, inner_dim, eps, modulated=True) for _ in range(num_layers))
        self.norm_out = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.out_modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)
        self.proj_out = nn.Linear(dim, action_dim)
        nn.init.zeros_(self.proj_out.weight)  # start by predicting zero velocity: no noise into the video stream
        nn.init.zeros_(self.proj_out.bias)

    def embed_time(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep [B] (1000 * noise level) -> (temb [B, D], modulation [B, 6, D]), in fp32."""
        freqs = get_timestep_embedding(timestep.float(), TIME_FREQ_DIM, flip_sin_to_cos=True,
                                       downscale_freq_shift=0)
        weight = self.time_embedder[0].weight
        temb = self.time_embedder(freqs.to(weight.dtype))
        return temb, self.time_proj(temb).unflatten(1, (6, -1))

    def embed_tokens(self, actions: torch.Tensor, state: torch.Tensor | None) -> torch.Tensor:
        tokens = [self.action_encoder(actions)]
        if self.use_state:
            if state is None:
                raise ValueError("model.mode is finetune but the batch has no 'state'; "
                                 "use model.mode=pretrain for data without robot state")
            assert self.registers is not None and self.state_encoder is not None  # built when use_state
            registers = self.registers.expand(actions.shape[0], -1, -1)
            tokens = [self.state_encoder(state)[:, None]] + tokens + [registers.to(tokens[0].dtype)]
        x = torch.cat(tokens, dim=1)
        return x + self.positions.to(x.dtype)

    def decode(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.out_modulation + temb[:, None].float()).chunk(2, dim=1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).to(x.dtype)
        start = 1 if self.use_state else 0
        return self.proj_out(x[:, start:start + self.action_chunk_size])


class UndExpert(nn.Module):
    """Frozen-VLM hidden states through the mlp3x_silu adapter; plain (unmodulated) blocks.

    As in Motus, the last block keeps its query, output projection and FFN although no
    later layer reads the understanding tokens: those parameters get exactly zero gradient
    (see WorldModel.velocity), which keeps the published parameter count."""

    def __init__(self, num_layers: int, dim: int, ffn_mult: int, inner_dim: int, eps: float, vlm_dim: int,
                 projector_type: str = "mlp3x_silu") -> None:
        super().__init__()
        if projector_type not in ADAPTERS:
            raise ValueError(f"model.und_expert.vlm.projector_type is '{projector_type}'; "
                             f"expected one of {', '.join(ADAPTERS)}")
        self.adapter = ADAPTERS[projector_type](vlm_dim, dim)
        self.layers = nn.ModuleList(
            ExpertBlock(dim, dim * ffn_mult, inner_dim, eps, modulated=False) for _ in range(num_layers))
