"""The tiny frozen VAE is fitted to the synthetic training videos while the tiny assets are built, so
decoded pictures show the squares; a random VAE's do not."""
import os

import numpy as np
import pytest
import torch

from helpers import ROOT

SQUARES_PSNR_DB = 15.0
"""Fitted: PSNR over the squares' pixels of held-out frames above this (measured 17.6 dB; the random
VAE 10.2 dB, the grey of a background-only reconstruction about 8 dB)."""


def squares_psnr(recon, true):
    """PSNR (pixels in [-1, 1]) over the pixels of coloured objects: grey background and black bars
    have equal channels, a square's colour does not. A VAE that draws only the background scores low."""
    mask = (true.max(dim=1, keepdim=True).values - true.min(dim=1, keepdim=True).values > 0.3).expand_as(true)
    return float(10 * torch.log10(4 / (recon.clamp(-1, 1) - true)[mask].pow(2).mean()))


@pytest.fixture(scope="module")
def built():
    """The repository's assets/, built as train/train.py builds them on a first run."""
    from data import build_datasets
    from data.synthetic import ensure_synthetic
    from models.tiny_assets import ensure_tiny_assets, training_videos
    from recipe.config import load_config

    os.chdir(ROOT)
    cfg = load_config("configs/tiny.yaml")
    ensure_synthetic(cfg)
    train_set, val_set, _ = build_datasets(cfg)
    ensure_tiny_assets(cfg, videos=lambda: training_videos(train_set, seed=cfg.training.seed))
    held_out = torch.stack([val_set.load(w)["video"] for w in val_set.val_windows()[:4]])
    return cfg, held_out.permute(0, 2, 1, 3, 4)  # [N, 3, T, H, W], the VAE's layout


def reconstruct(vae, x):
    with torch.no_grad():
        return vae.decode(vae.encode(x).latent_dist.mean).sample


def test_the_fitted_vae_shows_the_squares_and_a_random_one_does_not(built):
    import json

    from diffusers import AutoencoderKLWan

    from models.tiny_assets import STAMP, build_vae

    cfg, x = built
    stamp = json.loads(open(os.path.join(os.path.dirname(cfg.model.wan.vae_path), STAMP)).read())
    assert stamp["vae"] != "random"
    assert "fit" not in stamp  # the default fit is not named: folders built before model.tiny_vae_fit stay valid
    fitted = AutoencoderKLWan.from_pretrained(cfg.model.wan.vae_path).eval()
    assert squares_psnr(reconstruct(fitted, x), x) > SQUARES_PSNR_DB
    assert squares_psnr(reconstruct(build_vae(), x), x) < SQUARES_PSNR_DB - 3


def test_latent_statistics_are_measured_on_the_videos(built):
    from diffusers import AutoencoderKLWan

    cfg, x = built
    vae = AutoencoderKLWan.from_pretrained(cfg.model.wan.vae_path).eval()
    with torch.no_grad():
        mu = vae.encode(x).latent_dist.mean
    mean, std = np.array(vae.config.latents_mean), np.array(vae.config.latents_std)
    normalised = (mu - torch.tensor(mean).view(1, -1, 1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1, 1)
    # held-out windows of the same scenes: normalised latents are about zero-mean, unit-spread per channel
    assert np.abs(normalised.mean(dim=(0, 2, 3, 4)).numpy()).max() < 0.5
    assert np.abs(normalised.std(dim=(0, 2, 3, 4)).numpy() - 1).max() < 0.5


def test_a_folder_fitted_for_other_steps_is_refitted_and_one_fitted_alike_is_kept(tmp_path):
    """model.tiny_vae_fit is in the folder's stamp: a recipe that fits its VAE longer or shorter gets its own
    fit, never a folder fitted for another recipe's steps."""
    import json

    from models.config import TinyVAEFitConfig
    from models.tiny_assets import STAMP, build_tiny_assets

    clips = torch.rand(2, 5, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    fits = []

    def videos():
        fits.append(1)
        return clips

    folder, weights = tmp_path / "tiny", tmp_path / "tiny" / "vae" / "diffusion_pytorch_model.safetensors"
    short = TinyVAEFitConfig(frame_steps=1, clip_steps=1, videos=2)
    build_tiny_assets(str(folder), videos=videos, fit=short)
    first = weights.read_bytes()
    build_tiny_assets(str(folder), videos=videos, fit=short)
    assert len(fits) == 1 and weights.read_bytes() == first
    build_tiny_assets(str(folder), videos=videos, fit=TinyVAEFitConfig(frame_steps=2, clip_steps=1, videos=2))
    assert len(fits) == 2 and weights.read_bytes() != first
    assert json.loads((folder / STAMP).read_text())["fit"] == {"frame_steps": 2, "clip_steps": 1, "videos": 2}
