"""The tiny VAE's fit to a recipe's training videos, and the check that its decoded frames still show
the scene's coloured objects.

A small VAE fitted for a few hundred steps can end on a plateau where it draws the flat background
alone: its PSNR over the whole frame is that of a good fit (the objects are a few dozen pixels), but
a policy that reads such a latent never sees what it must reach. In gym-aloha's transfer_cube the red
cube is the only saturated colour in the scene, so "does the decoded frame still show a coloured
object" tells the two fits apart where PSNR cannot (measured on one machine's demonstrations: 0% of
the frames for a fit that lost the cube, 92% for one that kept it; TRAINING.md, "A short fit can lose
the cube altogether"). With model.tiny_vae_fit.min_colour_shown set, the fit runs its frame and clip
steps again until the check passes, at most model.tiny_vae_fit.max_rounds times.
"""
import logging
import time
from typing import TYPE_CHECKING

import torch

from models.config import TinyVAEFitConfig
from models.serialization import ModelLoadError

if TYPE_CHECKING:
    from diffusers import AutoencoderKLWan

log = logging.getLogger(__name__)

# the fit: single frames first (a fifth of a clip's cost: they train the spatial layers), then whole
# clips (the temporal layers); how many steps of each is model.tiny_vae_fit
FRAME_BATCH, CLIP_BATCH, FIT_LR = 16, 8, 1e-3
COLOUR_WEIGHT = 20.0
FIT_LOG_EVERY = 50  # steps between progress lines
# larger frames are fitted on random crops of this size: the VAE is convolutional, so a crop teaches it
# the same objects at the same scale, and the fit's cost stays that of a 96x128 frame
FIT_CROP = (96, 128)
# the check: a pixel is an object's when its saturation (largest minus smallest channel, in [0, 1])
# exceeds COLOURED in the original frame, or DECODED_COLOURED in the decoded one (a decoded object's
# colour is diluted by the blur); a frame shows an object with at least MIN_COLOURED such pixels
# (transfer_cube's cube: ~30-40 at 192x256, a lifted one partly hidden), its decoded frame with MIN_DECODED
COLOURED, DECODED_COLOURED = 0.4, 0.3
MIN_COLOURED, MIN_DECODED = 5, 3


def fit_vae(vae: "AutoencoderKLWan", x: torch.Tensor, gen: torch.Generator,
            fit: TinyVAEFitConfig = TinyVAEFitConfig()) -> "AutoencoderKLWan":
    """A short autoencoder fit of `vae` to videos x [N, 3, T, H, W]: Adam on the reconstruction of the
    posterior mean (what FrozenEncoders encodes), fit.frame_steps on single frames then fit.clip_steps
    on whole clips, on random FIT_CROP windows of larger frames. Each pixel's squared error is weighted
    by 1 + its colour saturation x COLOUR_WEIGHT: robot scenes are mostly flat background, and
    unweighted a small VAE learns the background alone, so the objects (the synthetic squares, the
    simulator's red cube) vanish from every decoded picture. (lr 1e-3: 5e-3 and above stall at that
    background-only plateau.) With fit.min_colour_shown > 0 the two stages run again, the optimizer
    carried on, until colour_shown(vae, x) reaches it; a fit still short of it after fit.max_rounds
    rounds raises ModelLoadError."""
    start, cpu = time.perf_counter(), time.process_time()
    frames = x.transpose(1, 2).reshape(-1, x.shape[1], 1, *x.shape[3:])  # every frame as a 1-frame clip
    opt = torch.optim.Adam(vae.parameters(), lr=FIT_LR)
    for fit_round in range(1, fit.max_rounds + 1):
        loss = _fit_round(vae, opt, frames, x, gen, fit)
        if fit.min_colour_shown <= 0:
            break
        shown = colour_shown(vae, x)
        log.info("tiny VAE fit: round %d/%d, decoded frames show the coloured objects of %.0f%% of the frames "
                 "(model.tiny_vae_fit.min_colour_shown %.0f%%)", fit_round, fit.max_rounds, 100 * shown,
                 100 * fit.min_colour_shown)
        if shown >= fit.min_colour_shown:
            break
    else:
        raise ModelLoadError(
            f"the tiny VAE fit to {len(x)} videos still draws the background alone after {fit.max_rounds} rounds of "
            f"{fit.frame_steps} frame + {fit.clip_steps} clip steps: its decoded frames show the coloured objects of "
            f"{100 * shown:.0f}% of the frames, model.tiny_vae_fit.min_colour_shown asks for "
            f"{100 * fit.min_colour_shown:.0f}%; raise model.tiny_vae_fit.max_rounds or the steps")
    vae.eval().requires_grad_(False)
    log.info("fitted the tiny VAE to %d videos: %d round(s) of %d frame + %d clip steps, final weighted MSE %.4f, "
             "%.1f s (%.1f CPU s)", len(x), fit_round, fit.frame_steps, fit.clip_steps, loss,
             time.perf_counter() - start, time.process_time() - cpu)
    return vae


def _fit_round(vae: "AutoencoderKLWan", opt: torch.optim.Optimizer, frames: torch.Tensor, x: torch.Tensor,
               gen: torch.Generator, fit: TinyVAEFitConfig) -> float:
    """fit.frame_steps on single frames, then fit.clip_steps on clips; the last step's weighted MSE."""
    vae.train()
    loss = torch.zeros(())
    for stage, data, steps, batch in (("frame", frames, fit.frame_steps, FRAME_BATCH),
                                      ("clip", x, fit.clip_steps, CLIP_BATCH)):
        for i in range(steps):
            b = random_crops(data[torch.randint(0, len(data), (min(batch, len(data)),), generator=gen)], gen)
            weight = 1 + COLOUR_WEIGHT * saturation(b).unsqueeze(1)
            rec = vae.decode(vae.encode(b).latent_dist.mean).sample
            loss = ((rec - b).pow(2) * weight).mean() / weight.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if (i + 1) % FIT_LOG_EVERY == 0:  # a long fit (minutes to an hour on a CPU) shows it moves
                log.info("tiny VAE fit: %s step %d/%d, weighted MSE %.4f", stage, i + 1, steps, loss.item())
    return loss.item()


def saturation(x: torch.Tensor) -> torch.Tensor:
    """[N, 3, ...] in [-1, 1] -> [N, ...]: each pixel's largest minus smallest channel, from 0 (greys,
    black and white) to 2: twice the saturation of the [0, 1] picture, which COLOURED is stated in."""
    return x.max(dim=1).values - x.min(dim=1).values


def colour_shown(vae: "AutoencoderKLWan", x: torch.Tensor) -> float:
    """The share of the frames of x [N, 3, T, H, W] in [-1, 1] that show a coloured object whose decoded
    frame (the posterior mean, as the latent cache encodes) shows one too; 1.0 when none shows one."""
    decoded = reconstruct(vae, x)
    original = (saturation(x.clamp(-1, 1)) / 2 > COLOURED).sum(dim=(-1, -2)) >= MIN_COLOURED
    kept = (saturation(decoded.clamp(-1, 1)) / 2 > DECODED_COLOURED).sum(dim=(-1, -2)) >= MIN_DECODED
    return float((original & kept).sum() / original.sum()) if original.any() else 1.0


def reconstruct(vae: "AutoencoderKLWan", x: torch.Tensor) -> torch.Tensor:
    """Videos x [N, 3, T, H, W] encoded to their posterior mean (what the latent cache holds) and decoded,
    CLIP_BATCH clips at a time, in eval mode and without gradients."""
    vae.eval()
    with torch.no_grad():
        return torch.cat([vae.decode(vae.encode(c).latent_dist.mean).sample for c in x.split(CLIP_BATCH)])


def random_crops(x: torch.Tensor, gen: torch.Generator, size: tuple[int, int] = FIT_CROP) -> torch.Tensor:
    """A random FIT_CROP window of each video of x [N, 3, T, H, W] (x itself when it is no larger)."""
    h, w = min(size[0], x.shape[-2]), min(size[1], x.shape[-1])
    if (h, w) == tuple(x.shape[-2:]):
        return x
    ys = torch.randint(0, x.shape[-2] - h + 1, (len(x),), generator=gen).tolist()
    xs = torch.randint(0, x.shape[-1] - w + 1, (len(x),), generator=gen).tolist()
    return torch.stack([v[..., y:y + h, x0:x0 + w] for v, y, x0 in zip(x, ys, xs)])
