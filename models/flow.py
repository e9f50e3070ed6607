"""Rectified flow: the noise-level law, the training targets and the Euler sampler.

`x_s = (1 - s) x0 + s eps`, target velocity `eps - x0`; s = 1 is pure noise. The video
and action streams draw s independently per sample (UniDiffuser style), which is what
lets one network serve the five inference modes below by choosing each stream's s.
"""
import torch

# Per mode, what each stream does: "generate" (Euler from s=1 to 0), "given" (clean input
# kept, s=0) or "marginal" (held at pure noise, s=1: the stream is integrated out).
MODES = {
    "joint": ("generate", "generate"),
    "policy": ("marginal", "generate"),
    "video": ("generate", "marginal"),
    "forward_dynamics": ("generate", "given"),
    "inverse_dynamics": ("given", "generate"),
}

NOISE_LAWS = ("logit_normal", "uniform")  # model.time_distribution.timestep_sample_method
MOTUS_NUM_TRAIN_STEPS = 1000  # the discrete schedule of `uniform` and the timestep scale of Wan


def shift_noise_levels(s, shift):
    """Timestep shift `shift * s / (1 + (shift - 1) * s)`: shift > 1 moves mass towards noise."""
    return shift * s / (1 + (shift - 1) * s)


def sample_noise_levels(n, td, device=None, generator=None):
    """Draw n noise levels in [0, 1] from `model.time_distribution` (`td`): the law, then the
    shift, then the [min_t, max_t] clamp."""
    if td.timestep_sample_method == "logit_normal":
        s = torch.sigmoid(td.sigmoid_scale * torch.randn(n, device=device, generator=generator))
    elif td.timestep_sample_method == "uniform":
        # Motus's discrete schedule s_j = 1 - j / 1000, j uniform in 0..999 (shift 5 gives Motus's sigmas)
        j = torch.randint(0, MOTUS_NUM_TRAIN_STEPS, (n,), device=device, generator=generator)
        s = 1 - j.float() / MOTUS_NUM_TRAIN_STEPS
    else:
        raise ValueError(f"model.time_distribution.timestep_sample_method is "
                         f"'{td.timestep_sample_method}'; expected logit_normal or uniform")
    return shift_noise_levels(s, td.shift).clamp(td.min_t, td.max_t)


def _bcast(s, x):
    return s.view(-1, *([1] * (x.dim() - 1))).to(x.dtype)


def add_noise(x0, eps, s):
    return (1 - _bcast(s, x0)) * x0 + _bcast(s, x0) * eps


def _draw_noise(x0, a0, td, generator):
    """Noise levels and noise of both streams for a batch, from one generator (or the global RNG)."""
    batch = x0.shape[0]
    s_video = sample_noise_levels(batch, td, x0.device, generator)
    s_action = sample_noise_levels(batch, td, x0.device, generator)
    eps_video = torch.randn(x0.shape, device=x0.device, generator=generator)
    eps_action = torch.randn(a0.shape, device=a0.device, generator=generator)
    return s_video, s_action, eps_video, eps_action


def _draw_noise_per_sample(x0, a0, td, seeds):
    """The same draw, sample by sample, each from a generator seeded by its own seed: a sample's
    noise then does not depend on which rank holds it or on its place in the batch, so runs
    with different process counts (and a resumed run) see the same noise."""
    draws = []
    for i, seed in enumerate(seeds.tolist()):
        g = torch.Generator().manual_seed(int(seed))
        draws.append(_draw_noise(x0[i:i + 1].cpu(), a0[i:i + 1].cpu(), td, g))
    return [torch.cat(parts).to(x0.device) for parts in zip(*draws)]


def flow_losses(model, inputs, generator=None):
    """Noise both streams at independent levels, predict velocities, return the losses.

    `inputs["noise_seeds"]` (int64 [B]), when present, seeds each sample's noise."""
    x0, a0 = inputs["video_latents"].float(), inputs["actions"].float()
    td = model.settings.time_distribution
    if inputs.get("noise_seeds") is not None:
        s_video, s_action, eps_video, eps_action = _draw_noise_per_sample(x0, a0, td, inputs["noise_seeds"])
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
    return {"loss": loss, "video_loss": video_loss.detach(), "action_loss": action_loss.detach(),
            "noise_level_video": s_video.mean().detach(), "noise_level_action": s_action.mean().detach()}


@torch.no_grad()
def euler_sample(model, inputs, mode, num_steps, generator=None, noise=None):
    """Integrate from s=1 to 0 over `linspace(1, 0, num_steps + 1)` for the streams that `mode`
    generates; given streams stay clean, marginal ones stay at pure noise. Latent frame 0
    is re-imposed after every step. Streams not generated are returned as given (or None).
    `noise`: (video, actions) starting noise instead of draws from `generator`, so a sample's
    result need not depend on the batch it is in."""
    if mode not in MODES:
        raise ValueError(f"sample mode '{mode}'; expected one of {', '.join(MODES)}")
    video_role, action_role = MODES[mode]
    given_video, given_actions = inputs["video_latents"].float(), inputs.get("actions")
    batch, device = given_video.shape[0], given_video.device
    video_shape = (batch, given_video.shape[1], model.latent_frames, *given_video.shape[3:])
    action_shape = (batch, model.action_chunk_size, model.action_dim)
    for role, name, value in (("given", "video", given_video), ("given", "actions", given_actions)):
        needs = (video_role if name == "video" else action_role) == role
        if needs and (value is None or (name == "video" and value.shape[2] < model.latent_frames)):
            raise ValueError(f"sample mode '{mode}' conditions on the whole {name}; the inputs lack it")
    if noise is None:
        x_video = torch.randn(video_shape, device=device, generator=generator)
        x_action = torch.randn(action_shape, device=device, generator=generator)
    else:
        x_video, x_action = (n.to(device, torch.float32).clone() for n in noise)
    if video_role == "given":
        x_video = given_video[:, :, :model.latent_frames].clone()
    if action_role == "given":
        x_action = given_actions.float().clone()
    x_video[:, :, :1] = given_video[:, :, :1]
    grid = torch.linspace(1.0, 0.0, num_steps + 1, device=device)
    level = {"given": 0.0, "marginal": 1.0}
    for i in range(num_steps):
        s, ds = grid[i], grid[i + 1] - grid[i]
        s_video = torch.full((batch,), float(level.get(video_role, s)), device=device)
        s_action = torch.full((batch,), float(level.get(action_role, s)), device=device)
        v_video, v_action = model.velocity(x_video, s_video, x_action, s_action, inputs)
        if video_role == "generate":
            x_video = x_video + ds * v_video.float()
            x_video[:, :, :1] = given_video[:, :, :1]
        if action_role == "generate":
            x_action = x_action + ds * v_action.float()
    return {"video_latents": x_video if video_role == "generate" else inputs["video_latents"],
            "actions": x_action if action_role == "generate" else given_actions}
