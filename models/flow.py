"""Rectified flow: the noise-level law, the training targets and the Euler sampler.

`x_s = (1 - s) x0 + s eps`, target velocity `eps - x0`; s = 1 is pure noise. The video
and action streams draw s independently per sample (UniDiffuser style), which is what
lets one network serve the five inference modes below by choosing each stream's s.
"""
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from models.config import TimeDistributionConfig
from utils.batch import FlowLosses, FlowSample, ModelBatch

if TYPE_CHECKING:  # world_model imports this module
    from models.world_model import WorldModel

# Per sampling mode, what each stream (video, actions) does: "generate" (Euler from s=1 to 0), "given"
# (clean input kept, s=0) or "marginal" (held at pure noise, s=1: the stream is integrated out).
# In the order inference.evaluate runs them by default.
SAMPLE_MODES = {
    "policy": ("marginal", "generate"),
    "joint": ("generate", "generate"),
    "video": ("generate", "marginal"),
    "forward_dynamics": ("generate", "given"),
    "inverse_dynamics": ("given", "generate"),
}
VIDEO_MODES = tuple(m for m, (video, _) in SAMPLE_MODES.items() if video == "generate")
"""The sampling modes that generate video (evaluation decodes and scores their frames)."""
ACTION_MODES = tuple(m for m, (_, actions) in SAMPLE_MODES.items() if actions == "generate")
"""The sampling modes that generate actions (evaluation scores their action chunks)."""

MOTUS_NUM_TRAIN_STEPS = 1000  # the discrete schedule of `uniform` and the timestep scale of Wan


def shift_noise_levels(s: torch.Tensor, shift: float) -> torch.Tensor:
    """Timestep shift `shift * s / (1 + (shift - 1) * s)`: shift > 1 moves mass towards noise."""
    return shift * s / (1 + (shift - 1) * s)


def action_shift(td: TimeDistributionConfig) -> float:
    """The action stream's timestep shift: `action_shift`, or the shared `shift` when it is null."""
    return td.shift if td.action_shift is None else td.action_shift


def sample_noise_levels(n: int, td: TimeDistributionConfig, device: torch.device | str | None = None,
                        generator: torch.Generator | None = None, shift: float | None = None) -> torch.Tensor:
    """Draw n noise levels in [0, 1] from `model.time_distribution` (`td`): the law, then the
    shift (`shift`, or `td.shift` when None), then the [min_t, max_t] clamp."""
    return _levels(td, lambda: torch.randn(n, device=device, generator=generator),
                   lambda: torch.rand(n, device=device, generator=generator), td.shift if shift is None else shift)


def _levels(td: TimeDistributionConfig, normal: Callable[[], torch.Tensor],
            uniform: Callable[[], torch.Tensor], shift: float) -> torch.Tensor:
    """The noise-level law applied to standard draws: `normal()` ~ N(0, 1), `uniform()` ~ U[0, 1)."""
    if td.timestep_sample_method == "logit_normal":
        s = torch.sigmoid(td.sigmoid_scale * normal())
    elif td.timestep_sample_method == "uniform":
        # Motus's discrete schedule s_j = 1 - j / 1000, j uniform in 0..999 (shift 5 gives Motus's sigmas)
        j = (uniform() * MOTUS_NUM_TRAIN_STEPS).floor().clamp(max=MOTUS_NUM_TRAIN_STEPS - 1)
        s = 1 - j / MOTUS_NUM_TRAIN_STEPS
    else:
        raise ValueError(f"model.time_distribution.timestep_sample_method is "
                         f"'{td.timestep_sample_method}'; expected logit_normal or uniform")
    return shift_noise_levels(s, shift).clamp(td.min_t, td.max_t)


# ---- per-sample seeded noise: a counter-based generator in tensor ops --------------------------
# Each sample's noise is a pure function of (its seed, the stream, the element's index), computed
# on whatever device the seeds live on, for the whole batch at once: no per-sample generator, no
# host round trip, and the same numbers whichever rank or batch position holds the sample.
# Integers stay below 2**49 in int64, so the arithmetic is exact on every device.
_MASK32 = 0xFFFFFFFF
VIDEO_LEVEL, ACTION_LEVEL, VIDEO_NOISE, ACTION_NOISE, VIDEO_MARGINAL = range(5)  # independent streams per sample


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in two 16-bit halves of the constant c."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser: a bijection of [0, 2**32) in which every input bit flips about
    half of the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _hash_bits(seeds: torch.Tensor, stream: int, count: int) -> torch.Tensor:
    """32 random bits [B, count] (int64) for element counters 0..count-1 of each sample's stream."""
    seeds = seeds.long().view(-1, 1)
    key = _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ _mix32(torch.full_like(seeds, stream))))
    key2 = _mix32(key ^ 0x5BD1E995)
    counter = torch.arange(count, device=seeds.device, dtype=torch.long).view(1, -1)
    return _mix32(_mix32(counter ^ key) ^ key2)


def seeded_uniform(seeds: torch.Tensor, stream: int, shape: Sequence[int]) -> torch.Tensor:
    """U[0, 1) draws [B, *shape] in float32 (24 random bits each) from per-sample int64 seeds [B]."""
    count = 1
    for d in shape:
        count *= d
    return ((_hash_bits(seeds, stream, count) >> 8).float() * 2.0 ** -24).view(-1, *shape)


def seeded_normal(seeds: torch.Tensor, stream: int, shape: Sequence[int]) -> torch.Tensor:
    """N(0, 1) draws [B, *shape] in float32 (Box-Muller on two seeded uniforms per element)."""
    u = seeded_uniform(seeds, stream, (2, *shape))
    radius = torch.sqrt(-2.0 * torch.log1p(-u[:, 0]))  # 1 - u in (0, 1]: the log is finite
    return radius * torch.cos(2 * torch.pi * u[:, 1])


def _bcast(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return s.view(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def add_noise(x0: torch.Tensor, eps: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (1 - _bcast(s, x0)) * x0 + _bcast(s, x0) * eps


def _draw_noise(x0: torch.Tensor, a0: torch.Tensor, td: TimeDistributionConfig, generator: torch.Generator | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise levels and noise of both streams for a batch, from one generator (or the global RNG)."""
    batch = x0.shape[0]
    s_video = sample_noise_levels(batch, td, x0.device, generator)
    s_action = sample_noise_levels(batch, td, x0.device, generator, action_shift(td))
    eps_video = torch.randn(x0.shape, device=x0.device, generator=generator)
    eps_action = torch.randn(a0.shape, device=a0.device, generator=generator)
    if td.marginal_video_fraction > 0:  # drawn last, so that the draws above are those of a run without it
        s_video = _hold_marginal(s_video, torch.rand(batch, device=x0.device, generator=generator), td)
    return s_video, s_action, eps_video, eps_action


def _hold_marginal(s_video: torch.Tensor, u: torch.Tensor, td: TimeDistributionConfig) -> torch.Tensor:
    """Video levels with the samples whose uniform draw `u` falls below `marginal_video_fraction` set to 1:
    pure noise, as the `policy` sampling mode holds the video while it generates the actions."""
    return torch.where(u < td.marginal_video_fraction, torch.ones_like(s_video), s_video)


def _draw_noise_per_sample(x0: torch.Tensor, a0: torch.Tensor, td: TimeDistributionConfig, seeds: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same draw with each sample's noise a pure function of its own seed (seeded_normal /
    seeded_uniform, on the latents' device): a sample's noise then does not depend on which rank
    holds it or on its place in the batch, so runs with different process counts (and a resumed
    run) see the same noise."""
    seeds = seeds.to(x0.device, non_blocking=True)

    def levels(stream: int, shift: float) -> torch.Tensor:
        return _levels(td, lambda: seeded_normal(seeds, stream, (1,))[:, 0],
                       lambda: seeded_uniform(seeds, stream, (1,))[:, 0], shift)

    s_video = levels(VIDEO_LEVEL, td.shift)
    if td.marginal_video_fraction > 0:
        s_video = _hold_marginal(s_video, seeded_uniform(seeds, VIDEO_MARGINAL, (1,))[:, 0], td)
    return (s_video, levels(ACTION_LEVEL, action_shift(td)), seeded_normal(seeds, VIDEO_NOISE, x0.shape[1:]),
            seeded_normal(seeds, ACTION_NOISE, a0.shape[1:]))


def flow_losses(model: "WorldModel", inputs: ModelBatch,
                generator: torch.Generator | None = None) -> FlowLosses:
    """Noise both streams at independent levels, predict velocities, return the losses.

    `inputs.noise_seeds`, when given, seeds each sample's noise."""
    if inputs.actions is None:
        raise ValueError("flow_losses needs the batch's actions (ModelBatch.actions is None)")
    x0, a0 = inputs.video_latents.float(), inputs.actions.float()
    td = model.settings.time_distribution
    if inputs.noise_seeds is not None:
        s_video, s_action, eps_video, eps_action = _draw_noise_per_sample(x0, a0, td, inputs.noise_seeds)
    else:
        s_video, s_action, eps_video, eps_action = _draw_noise(x0, a0, td, generator)
    x_video = add_noise(x0, eps_video, s_video)
    x_video[:, :, :1] = x0[:, :, :1]  # teacher forcing: latent frame 0 is the clean condition
    x_action = add_noise(a0, eps_action, s_action)
    v_video, v_action = model.velocity(x_video, s_video, x_action, s_action, inputs)
    # frame 0 is given, so it carries no loss
    video_loss = (v_video[:, :, 1:].float() - (eps_video - x0)[:, :, 1:]).pow(2).mean()
    action_loss = (v_action.float() - (eps_action - a0)).pow(2).mean()
    w = model.settings.loss_weights
    loss = w.video_loss_weight * video_loss + w.action_loss_weight * action_loss
    return FlowLosses(loss=loss, video_loss=video_loss.detach(), action_loss=action_loss.detach(),
                      noise_level_video=s_video.mean().detach(), noise_level_action=s_action.mean().detach())


@torch.no_grad()
def euler_sample(model: "WorldModel", inputs: ModelBatch, mode: str, num_steps: int,
                 generator: torch.Generator | None = None, noise: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> FlowSample:
    """Integrate from s=1 to 0 over `linspace(1, 0, num_steps + 1)` for the streams that `mode`
    generates; given streams stay clean, marginal ones stay at pure noise. Latent frame 0
    is re-imposed after every step. Streams not generated are returned as given (or None).
    `noise`: (video, actions) starting noise instead of draws from `generator`, so a sample's
    result need not depend on the batch it is in."""
    if mode not in SAMPLE_MODES:
        raise ValueError(f"sample mode '{mode}'; expected one of {', '.join(SAMPLE_MODES)}")
    video_role, action_role = SAMPLE_MODES[mode]
    given_video, given_actions = inputs.video_latents.float(), inputs.actions
    batch, device = given_video.shape[0], given_video.device
    video_shape = (batch, given_video.shape[1], model.latent_frames, *given_video.shape[3:])
    action_shape = (batch, model.action_chunk_size, model.action_dim)
    lacks = {"video": video_role == "given" and given_video.shape[2] < model.latent_frames,
             "actions": action_role == "given" and given_actions is None}
    for name in (n for n, missing in lacks.items() if missing):
        raise ValueError(f"sample mode '{mode}' conditions on the whole {name}; the inputs lack it")
    if noise is None:
        x_video = torch.randn(video_shape, device=device, generator=generator)
        x_action = torch.randn(action_shape, device=device, generator=generator)
    else:
        x_video, x_action = (n.to(device, torch.float32).clone() for n in noise)
    if video_role == "given":
        x_video = given_video[:, :, :model.latent_frames].clone()
    if action_role == "given" and given_actions is not None:  # not None: checked above
        x_action = given_actions.float().clone()
    x_video[:, :, :1] = given_video[:, :, :1]
    grid = torch.linspace(1.0, 0.0, num_steps + 1, device=device)
    level = {"given": 0.0, "marginal": 1.0}
    for i in range(num_steps):
        s, ds = grid[i], grid[i + 1] - grid[i]
        # s stays on the device: no read-back per Euler step
        s_video = torch.full((batch,), level[video_role], device=device) if video_role in level else s.expand(batch)
        s_action = torch.full((batch,), level[action_role], device=device) if action_role in level else s.expand(batch)
        v_video, v_action = model.velocity(x_video, s_video, x_action, s_action, inputs)
        if video_role == "generate":
            x_video = x_video + ds * v_video.float()
            x_video[:, :, :1] = given_video[:, :, :1]
        if action_role == "generate":
            x_action = x_action + ds * v_action.float()
    return FlowSample(video_latents=x_video if video_role == "generate" else inputs.video_latents,
                      actions=x_action if action_role == "generate" else given_actions)
