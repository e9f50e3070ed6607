"""The tiny VAE's fit (models/vae_fit.py): random crops of large frames, progress lines, and the check
that keeps fitting while the decoded frames have lost the scene's coloured objects."""
import logging
from types import SimpleNamespace

import pytest
import torch

from models import vae_fit
from models.config import TinyVAEFitConfig
from models.serialization import ModelLoadError


def test_frames_larger_than_the_fit_crop_are_fitted_on_exact_random_windows():
    gen = torch.Generator().manual_seed(0)
    h, w = vae_fit.FIT_CROP
    x = torch.arange(3 * 3 * 2 * (h + 40) * (w + 8), dtype=torch.float32).view(3, 3, 2, h + 40, w + 8)
    crops = vae_fit.random_crops(x, gen)
    assert crops.shape == (3, 3, 2, h, w)
    offsets = set()
    for video, crop in zip(x, crops):
        y0, x0 = divmod(int(crop[0, 0, 0, 0] - video[0, 0, 0, 0]), w + 8)  # the window's top-left pixel
        assert torch.equal(crop, video[..., y0:y0 + h, x0:x0 + w])
        offsets.add((y0, x0))
    assert len(offsets) > 1  # each video its own window
    small = torch.zeros(2, 3, 1, h, w - 8)
    assert vae_fit.random_crops(small, gen) is small


def test_a_long_fit_logs_its_progress(monkeypatch, caplog):
    """Every FIT_LOG_EVERY steps of each stage a line says where the fit is (a 4x fit runs 11 minutes on 2 cores)."""
    from models import tiny_assets

    monkeypatch.setattr(vae_fit, "FIT_LOG_EVERY", 2)
    clips = torch.rand(2, 5, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with caplog.at_level(logging.INFO, logger=vae_fit.log.name):
        tiny_assets.build_vae(videos=clips, fit=TinyVAEFitConfig(frame_steps=4, clip_steps=3, videos=2))
    steps = [m for m in caplog.messages if m.startswith("tiny VAE fit:")]
    assert [m.split(", ")[0] for m in steps] == ["tiny VAE fit: frame step 2/4", "tiny VAE fit: frame step 4/4",
                                                 "tiny VAE fit: clip step 2/3"]


def grey_scene_with_a_red_cube(frames_with_cube: int, frames: int = 4) -> torch.Tensor:
    """[1, 3, frames, 32, 32] in [-1, 1]: a grey table, a 4x4 red cube (16 pixels of saturation 0.8) in the
    first `frames_with_cube` frames."""
    x = torch.full((1, 3, frames, 32, 32), 0.1)
    x[0, 0, :frames_with_cube, 10:14, 10:14] = 0.9
    x[0, 1:, :frames_with_cube, 10:14, 10:14] = -0.7
    return x


def autoencoder(decode):
    """A stand-in with AutoencoderKLWan's encode/decode interface: the latent is the video, decoded by `decode`."""
    return SimpleNamespace(eval=lambda: None,
                           encode=lambda x: SimpleNamespace(latent_dist=SimpleNamespace(mean=x)),
                           decode=lambda z: SimpleNamespace(sample=decode(z)))


def test_colour_shown_counts_the_frames_whose_decoded_picture_keeps_the_object():
    x = grey_scene_with_a_red_cube(frames_with_cube=3)
    assert vae_fit.colour_shown(autoencoder(lambda z: z), x) == 1.0
    assert vae_fit.colour_shown(autoencoder(lambda z: torch.full_like(z, 0.1)), x) == 0.0  # the table alone

    def lose_the_cube_in_the_second_frame(z):
        out = z.clone()
        out[:, :, 1] = 0.1
        return out
    assert vae_fit.colour_shown(autoencoder(lose_the_cube_in_the_second_frame), x) == pytest.approx(2 / 3)

    def dilute(z, by):  # the decoded cube's colour mixed with the grey table
        return 0.1 + (z - 0.1) * by
    assert vae_fit.colour_shown(autoencoder(lambda z: dilute(z, 0.8)), x) == 1.0   # saturation 0.64 > 0.3
    assert vae_fit.colour_shown(autoencoder(lambda z: dilute(z, 0.3)), x) == 0.0   # 0.24: washed out
    assert vae_fit.colour_shown(autoencoder(lambda z: z), grey_scene_with_a_red_cube(0)) == 1.0  # nothing to lose


def test_a_fit_that_passes_the_check_at_once_is_the_unchecked_fit_bit_for_bit():
    """The check reads the fit, never changes it: a recipe that turns it on keeps the weights a fit
    that already shows its objects would have had."""
    from models.tiny_assets import build_vae

    clips = grey_scene_with_a_red_cube(3).permute(0, 2, 1, 3, 4).repeat(2, 1, 1, 1, 1)  # [N, T, 3, H, W]
    unchecked = build_vae(videos=clips, fit=TinyVAEFitConfig(frame_steps=2, clip_steps=1, videos=2))
    checked = build_vae(videos=clips, fit=TinyVAEFitConfig(frame_steps=2, clip_steps=1, videos=2,
                                                           min_colour_shown=1e-9, max_rounds=3))
    free = build_vae(videos=clips * 0, fit=TinyVAEFitConfig(frame_steps=2, clip_steps=1, videos=2))
    grey = build_vae(videos=clips * 0, fit=TinyVAEFitConfig(frame_steps=2, clip_steps=1, videos=2,
                                                            min_colour_shown=1.0, max_rounds=3))
    for a, b in ((unchecked, checked), (free, grey)):  # a grey scene has no object to lose: 1.0, one round
        assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_fit_runs_more_rounds_until_the_objects_show_and_fails_naming_the_key(monkeypatch, caplog):
    shares = iter([0.0, 0.2, 0.7])
    monkeypatch.setattr(vae_fit, "colour_shown", lambda vae, x: next(shares))
    steps = []
    real_round = vae_fit._fit_round
    monkeypatch.setattr(vae_fit, "_fit_round", lambda *a: steps.append(1) or real_round(*a))
    clips = grey_scene_with_a_red_cube(3).permute(0, 2, 1, 3, 4)
    from models.tiny_assets import build_vae

    fit = TinyVAEFitConfig(frame_steps=1, clip_steps=1, videos=1, min_colour_shown=0.5, max_rounds=4)
    with caplog.at_level(logging.INFO, logger=vae_fit.log.name):
        build_vae(videos=clips, fit=fit)
    assert len(steps) == 3  # 0%, 20%, then 70% >= 50%: stops after the third round
    assert any("round 3/4, decoded frames show the coloured objects of 70% of the frames" in m for m in caplog.messages)

    shares = iter([0.0, 0.1])
    with pytest.raises(ModelLoadError, match=r"after 2 rounds of 1 frame \+ 1 clip steps: its decoded frames show "
                                             r"the coloured objects of 10% of the frames, "
                                             r"model.tiny_vae_fit.min_colour_shown asks for 50%"):
        build_vae(videos=clips, fit=TinyVAEFitConfig(frame_steps=1, clip_steps=1, videos=1, min_colour_shown=0.5,
                                                     max_rounds=2))


def test_the_check_keys_enter_the_fit_record_only_when_set():
    """Folders and latent caches fitted before the check existed keep their stamp and fingerprint."""
    assert TinyVAEFitConfig().record() is None
    assert TinyVAEFitConfig(frame_steps=600).record() == {"frame_steps": 600, "clip_steps": 120, "videos": 64}
    assert TinyVAEFitConfig(min_colour_shown=0.5, max_rounds=4).record() == {
        "frame_steps": 150, "clip_steps": 120, "videos": 64, "min_colour_shown": 0.5, "max_rounds": 4}
