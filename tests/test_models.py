"""The world model: tiny shapes and losses, gradients, the noise-level law, inference modes,
export round trip, full-size counts on meta, loading errors."""
import json
import logging
import math
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from models import ModelLoadError, build_world_model  # noqa: E402
from models.flow import SAMPLE_MODES, sample_noise_levels, shift_noise_levels  # noqa: E402
from models.config import TimeDistributionConfig  # noqa: E402
from recipe.config import load_config  # noqa: E402
from utils.batch import DataBatch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_yaml):
    torch.manual_seed(0)
    model, encoders = build_world_model(load_config(tiny_yaml))  # builds the assets on first use
    assert float(model.action_expert.proj_out.weight.detach().abs().sum()) == 0.0  # zero-initialised decoder
    with torch.no_grad():  # a decoder as after training, so the action paths show in the outputs
        model.action_expert.proj_out.weight.normal_(0, 0.1)
    gen = torch.Generator().manual_seed(0)
    batch = DataBatch(video=torch.rand(2, 5, 3, 64, 64, generator=gen) * 2 - 1,
                      state=torch.randn(2, 4, generator=gen), actions=torch.randn(2, 8, 4, generator=gen),
                      instruction=["push the red cube left", "open the drawer"])
    return model, encoders, encoders.encode(batch)


def test_tiny_shapes_and_weighted_loss(tiny):
    model, encoders, inputs = tiny
    assert inputs.video_latents.shape == (2, 8, 2, 8, 8)  # z=8, 1 + 4/4 frames, 64/8 cells
    assert inputs.text_embeds.shape == (2, 16, 32) and inputs.text_mask.dtype == torch.bool
    assert inputs.vlm_features.shape[0] == 2 and inputs.vlm_features.shape[2] == 32
    assert model.action_expert.positions.shape[1] == 13  # state, chunk of 8, 4 registers
    assert inputs.vlm_mask.sum(1).tolist()[0] > inputs.vlm_mask.sum(1).tolist()[1]  # padded shorter prompt
    # text embeddings are zero past the prompt, and cached per instruction
    assert float(inputs.text_embeds[~inputs.text_mask].abs().sum()) == 0.0
    again, _ = encoders.encode_text(["open the drawer"])
    assert torch.equal(again[0], inputs.text_embeds[1])
    out = model(inputs, generator=torch.Generator().manual_seed(1))
    loss = out.loss.detach()
    assert loss.dim() == 0 and math.isfinite(loss.item())
    assert float(loss) == pytest.approx(float(out.video_loss + out.action_loss), rel=1e-6)
    # the model section's loss weights are applied
    model.settings.loss_weights.video_loss_weight, model.settings.loss_weights.action_loss_weight = 2.0, 0.5
    try:
            out2 = model(inputs, generator=torch.Generator().manual_seed(1)).loss.detach()
    finally:
        model.settings.loss_weights.video_loss_weight, model.settings.loss_weights.action_loss_weight = 1.0, 1.0
    assert float(out2) == pytest.approx(2 * float(out.video_loss) + 0.5 * float(out.action_loss),
                                                rel=1e-6)
    pixels = encoders.decode_video(inputs.video_latents)
    assert pixels.shape == (2, 5, 3, 64, 64) and float(pixels.abs().max()) <= 1.0


def test_first_latent_frame_is_clean_and_carries_no_loss(tiny, monkeypatch):
    model, _, inputs = tiny
    seen = {}
    real = model.velocity

    def spy(x_video, s_video, x_action, s_action, inp):
        seen["frame0"] = x_video[:, :, 0].clone()
        v_video, v_action = real(x_video, s_video, x_action, s_action, inp)
        seen["v"] = v_video
        return v_video, v_action

    monkeypatch.setattr(model, "velocity", spy)
    out = model(inputs, generator=torch.Generator().manual_seed(2))
    assert torch.equal(seen["frame0"], inputs.video_latents[:, :, 0])

    def garbage_frame0(*args):
        v_video, v_action = real(*args)
        v_video = v_video.clone()
        v_video[:, :, 0] = 1e6
        return v_video, v_action

    monkeypatch.setattr(model, "velocity", garbage_frame0)
    out2 = model(inputs, generator=torch.Generator().manual_seed(2))
    assert float(out2.video_loss) == pytest.approx(float(out.video_loss), rel=1e-6)


def test_gradients_reach_every_trainable_parameter_and_no_frozen_one(tiny):
    model, encoders, inputs = tiny
    model.zero_grad(set_to_none=True)
    model(inputs, generator=torch.Generator().manual_seed(3)).loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    zero = sorted(n for n, p in model.named_parameters() if float(p.grad.abs().sum()) == 0)
    # only what no later layer reads: the last understanding block's query side, output and FFN
    last = f"und_expert.layers.{len(model.und_expert.layers) - 1}."
    assert zero == sorted(last + k for k in ("to_q.weight", "norm_q.weight", "to_out.weight", "ffn.0.weight",
                                             "ffn.0.bias", "ffn.2.weight", "ffn.2.bias"))
    assert all(p.requires_grad for p in model.parameters())
    for module in encoders.modules():
        assert all(not p.requires_grad and p.grad is None for p in module.parameters())
        assert not module.training
    model.zero_grad(set_to_none=True)


def _probit(q):
    return math.sqrt(2) * torch.erfinv(torch.as_tensor(2 * q - 1, dtype=torch.float64))


def test_noise_level_law_follows_the_config():
    n, gen = 20000, torch.Generator().manual_seed(0)
    td = TimeDistributionConfig(timestep_sample_method="logit_normal", sigmoid_scale=1.5, min_t=0.05, max_t=0.97,
                                shift=3.0)
    s = sample_noise_levels(n, td, generator=gen).double().sort().values
    qs = torch.linspace(0.05, 0.95, 19, dtype=torch.float64)
    expected = shift_noise_levels(torch.sigmoid(1.5 * _probit(qs)), 3.0).clamp(0.05, 0.97)
    empirical_cdf = torch.searchsorted(s, expected).double() / n
    assert float((empirical_cdf - qs).abs().max()) < 0.02  # KS-style distance at 19 quantiles
    assert float(s.min()) == pytest.approx(0.05) and float(s.max()) == pytest.approx(0.97)  # clamped
    # uniform: Motus's discrete schedule s_j = 1 - j/1000 with shift 5 (sigma = 5 s / (1 + 4 s))
    td = TimeDistributionConfig(timestep_sample_method="uniform", shift=5.0)
    sig = sample_noise_levels(n, td, generator=gen).double()
    s_back = sig / (5 - 4 * sig)  # invert the shift
    j = (1 - s_back) * 1000
    assert float((j - j.round()).abs().max()) < 1e-3 and int(j.round().min()) >= 0 and int(j.round().max()) <= 999
    assert float((torch.sort(j).values - torch.linspace(0, 999, n, dtype=torch.float64)).abs().max()) < 25
    assert float(sig.median()) == pytest.approx(5 * 0.5 / (1 + 4 * 0.5), abs=0.02)


def test_training_really_uses_time_distribution(tiny):
    model, _, inputs = tiny
    td = model.settings.time_distribution
    old = (td.min_t, td.max_t)
    td.min_t = td.max_t = 0.3
    try:
        out = model(inputs, generator=torch.Generator().manual_seed(4))
    finally:
        td.min_t, td.max_t = old
    assert float(out.noise_level_video) == pytest.approx(0.3) and float(out.noise_level_action) == pytest.approx(0.3)


def test_marginal_video_fraction_trains_the_policy_modes_video_state(tiny, monkeypatch):
    """marginal_video_fraction holds that share of the samples' video at pure noise (s = 1, the video
    frames equal to their noise) on both noise paths; at 0 every draw is that of a run without the key."""
    model, _, inputs = tiny
    td = model.settings.time_distribution
    seen = []
    real = model.velocity

    def spy(x_video, s_video, x_action, s_action, inp):
        seen.append((x_video.clone(), s_video.clone(), x_action.clone(), s_action.clone()))
        return real(x_video, s_video, x_action, s_action, inp)

    monkeypatch.setattr(model, "velocity", spy)
    seeds = torch.arange(2000, 2002)
    draws = {}
    for fraction in (0.0, 1.0):
        monkeypatch.setattr(td, "marginal_video_fraction", fraction)
        model(inputs, generator=torch.Generator().manual_seed(3))
        model(inputs.replace(noise_seeds=seeds))
        draws[fraction] = seen[-2:]
    for without, held in zip(draws[0.0], draws[1.0]):
        assert torch.equal(held[1], torch.ones(2)) and bool((without[1] < 1).all())
        assert torch.equal(held[2], without[2]) and torch.equal(held[3], without[3])  # actions untouched
        # frames 1.. are the noise itself; frame 0 stays the clean condition
        assert torch.equal(held[0][:, :, :1], inputs.video_latents[:, :, :1].float())
        noise = (without[0][:, :, 1:] - (1 - without[1]).view(-1, 1, 1, 1, 1) * inputs.video_latents[:, :, 1:]) \
            / without[1].view(-1, 1, 1, 1, 1)
        assert torch.allclose(held[0][:, :, 1:], noise, atol=1e-5)
    # a share: over many per-sample seeds, about that fraction is held, the rest drawn as before
    from models.flow import _draw_noise_per_sample
    monkeypatch.setattr(td, "marginal_video_fraction", 0.25)
    many = torch.arange(4000)
    x0, a0 = torch.zeros(4000, 1, 2, 1, 1), torch.zeros(4000, 1, 1)
    s_video = _draw_noise_per_sample(x0, a0, td, many)[0]
    monkeypatch.setattr(td, "marginal_video_fraction", 0.0)
    s_plain = _draw_noise_per_sample(x0, a0, td, many)[0]
    held = s_video == 1
    assert abs(float(held.double().mean()) - 0.25) < 0.03 and torch.equal(s_video[~held], s_plain[~held])


def test_action_shift_moves_the_action_levels_alone():
    """action_shift replaces `shift` for the action stream on both noise paths: the same standard draws,
    shifted by it; the video's levels and both streams' noise are those of a run without the key."""
    from models.flow import _draw_noise, _draw_noise_per_sample
    x0, a0, seeds = torch.zeros(4000, 1, 2, 1, 1), torch.zeros(4000, 3, 2), torch.arange(4000)
    for shift in (1.0, 3.0):
        plain = TimeDistributionConfig(shift=shift)
        moved = TimeDistributionConfig(shift=shift, action_shift=0.5)
        for draw in (lambda td: _draw_noise(x0, a0, td, torch.Generator().manual_seed(7)),
                     lambda td: _draw_noise_per_sample(x0, a0, td, seeds)):
            (v0, s0, ev0, ea0), (v1, s1, ev1, ea1) = draw(plain), draw(moved)
            assert torch.equal(v0, v1) and torch.equal(ev0, ev1) and torch.equal(ea0, ea1)
            unshifted = s0 / (shift - (shift - 1) * s0)  # shift's inverse
            assert torch.allclose(s1, shift_noise_levels(unshifted, 0.5), atol=1e-6)
            # toward clean: the median 0.5 of the logit-normal law moves to 0.5 * 0.5 / (1 - 0.5 * 0.5)
            assert float(s1.median()) == pytest.approx(1 / 3, abs=0.02) and float(v1.median()) > 0.45
            assert torch.equal(draw(TimeDistributionConfig(shift=shift, action_shift=shift))[1], s0)


def test_inference_modes_respect_their_conditioning(tiny):
    model, _, inputs = tiny
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    out = {m: model.sample(inputs, m, num_steps=2, generator=gen()) for m in SAMPLE_MODES}
    for m, o in out.items():
        assert o.video_latents.shape == inputs.video_latents.shape and o.actions.shape == (2, 8, 4), m
        assert torch.equal(o.video_latents[:, :, 0], inputs.video_latents[:, :, 0]), m
        assert torch.isfinite(o.actions).all() and torch.isfinite(o.video_latents).all(), m
    assert out["policy"].video_latents is inputs.video_latents
    assert out["inverse_dynamics"].video_latents is inputs.video_latents
    assert torch.equal(out["forward_dynamics"].actions, inputs.actions)
    assert out["video"].actions is inputs.actions
    assert not torch.equal(out["joint"].video_latents[:, :, 1:], inputs.video_latents[:, :, 1:])
    # policy integrates the future video out: changing it does not change the actions...
    changed = inputs.replace(video_latents=inputs.video_latents.clone())
    changed.video_latents[:, :, 1:] += 1.0
    assert torch.equal(model.sample(changed, "policy", 2, gen()).actions, out["policy"].actions)
    # ...while inverse dynamics reads it
    assert not torch.equal(model.sample(changed, "inverse_dynamics", 2, gen()).actions,
                           out["inverse_dynamics"].actions)
    # forward dynamics reads the given actions
    moved = inputs.replace(actions=inputs.actions + 1.0)
    assert not torch.equal(model.sample(moved, "forward_dynamics", 2, gen()).video_latents,
                           out["forward_dynamics"].video_latents)
    with pytest.raises(ValueError, match="expected one of"):
        model.sample(inputs, "dream")


@pytest.mark.parametrize("shard_bytes", [None, 20_000])
def test_save_load_round_trip_is_exact(tiny, tmp_path, shard_bytes):
    from models import WorldModel

    model, _, inputs = tiny
    kwargs = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
    model.save_pretrained(tmp_path, **kwargs)
    files = os.listdir(tmp_path)
    assert "config.json" in files
    assert ("model.safetensors" in files) == (shard_bytes is None)
    assert ("model.safetensors.index.json" in files) == (shard_bytes is not None)
    loaded = WorldModel.from_pretrained(tmp_path)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    la = model(inputs, generator=torch.Generator().manual_seed(6)).loss.detach()
    lb = loaded(inputs, generator=torch.Generator().manual_seed(6)).loss.detach()
    assert la.item() == lb.item()


def test_precision_and_checkpointing_switches(tiny_yaml, tiny):
    _, _, inputs = tiny
    cfg = load_config(tiny_yaml, ["model.precision=bf16_mixed", "model.gradient_checkpointing=true"])
    model, _ = build_world_model(cfg)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["video.blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["video.blocks.0.scale_shift_table"] == torch.float32
    assert dtypes["action_expert.time_embedder.0.weight"] == torch.float32
    out = model(inputs, generator=torch.Generator().manual_seed(7))
    out.loss.backward()
    assert math.isfinite(out.loss.detach().item()) and model.video.proj_out.weight.grad is not None
    # gradient checkpointing recomputes, it does not change the numbers
    cfg = load_config(tiny_yaml)
    torch.manual_seed(0)
    plain, _ = build_world_model(cfg)
    plain_loss = plain(inputs, generator=torch.Generator().manual_seed(8)).loss
    plain_loss.backward()
    plain_loss = plain_loss.detach()
    plain.gradient_checkpointing = True
    ckpt_grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    plain.zero_grad(set_to_none=True)
    ckpt_loss = plain(inputs, generator=torch.Generator().manual_seed(8)).loss
    ckpt_loss.backward()
    assert ckpt_loss.detach().item() == plain_loss.item()
    assert all(torch.allclose(p.grad, ckpt_grads[n], atol=1e-6) for n, p in plain.named_parameters())


def expert_count(dim, ffn, layers, inner, modulated, encoders):
    """Closed form of one expert's parameters (docs/architecture.md), independent of models/experts.py:
    per block q/k/v/o projections into the Wan head space, q/k RMSNorms and the FFN (+ AdaLN table)."""
    block = 4 * inner * dim + 2 * inner + 2 * dim * ffn + ffn + dim + (6 * dim if modulated else 0)
    return layers * block + encoders


def test_full_size_counts_on_meta(tmp_path):
    """The full-size parts against Motus's published counts (to their printed precision) and the
    experts against their closed form; the Wan and Qwen3-VL classes are diffusers'/transformers' own."""
    from models.memory_model import summarize

    path = tmp_path / "motus.yaml"
    path.write_text("common: {action_dim: 14, state_dim: 14, num_video_frames: 8}\n"
                    "model: {size: motus, precision: bf16_mixed}\ntraining: {ema: {enabled: true}}\n")
    out = summarize(load_config(str(path)), gpus=8)
    counts = out["parameters"]
    # Motus README: video ~5.00B, VLM ~2.13B, action expert ~641.5M, understanding expert ~253.5M
    published = {"video": (5.00e9, 0.005e9), "vlm": (2.13e9, 0.005e9), "action_expert": (641.5e6, 0.05e6),
                 "und_expert": (253.5e6, 0.05e6)}
    for name, (want, rounding) in published.items():
        assert abs(counts[name] - want) <= rounding, (name, counts[name], want)
    D, inner, a = 1024, 3072, 14
    mlp = lambda n: (n * D + D) + 2 * (D * D + D)  # noqa: E731  Linear, SiLU, Linear, SiLU, Linear
    time = (256 * D + D) + (D * D + D) + (6 * D * D + 6 * D)
    head = 2 * D + D * a + a  # out_modulation + proj_out
    assert counts["action_expert"] == expert_count(D, 4 * D, 30, inner, True, mlp(a) + mlp(a) + 4 * D + time + head)
    adapter = (2048 * 512 + 512) + 2 * (512 * 512 + 512)
    assert counts["und_expert"] == expert_count(512, 2048, 30, inner, False, adapter)
    mem = out["memory_gib_per_gpu"]
    assert mem["zero0"]["optimizer_state"] == pytest.approx(8 * mem["zero1"]["optimizer_state"], rel=0.01)
    assert mem["zero2"]["gradients"] == pytest.approx(mem["zero1"]["gradients"] / 8, rel=0.01)
    trainable = out["trainable"]  # the EMA: 4 bytes per trainable parameter, divided by the GPUs from ZeRO-1 on
    assert mem["zero0"]["ema"] == round(4 * trainable / 2 ** 30, 2)
    assert mem["zero1"]["ema"] == mem["zero2"]["ema"] == round(4 * trainable / 8 / 2 ** 30, 2)
    path.write_text("common: {action_dim: 14, state_dim: 14, num_video_frames: 8}\n"
                    "model: {size: motus, mode: pretrain}\n")
    pretrain = summarize(load_config(str(path)), gpus=1)["parameters"]["action_expert"]
    assert pretrain == counts["action_expert"] - mlp(a) - 4 * D  # no state encoder, no registers


def test_bad_paths_raise_clear_errors(tiny_yaml, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError, match=f"model.wan.checkpoint_path: '{missing}' does not exist"):
        build_world_model(load_config(tiny_yaml, [f"model.wan.checkpoint_path={missing}"]))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weights"):
        build_world_model(load_config(tiny_yaml, [f"model.vlm.checkpoint_path={empty}"]))
    with pytest.raises(ModelLoadError, match="input_dim is 2048"):
        build_world_model(load_config(tiny_yaml, ["model.und_expert.vlm.input_dim=2048"]))
    # tiny frozen parts built from an older tiny size table (or VAE recipe) are rebuilt, not silently used
    stale = tmp_path / "stale"
    shutil.copytree(os.path.dirname(load_config(tiny_yaml).model.wan.vae_path), stale)
    (stale / "tiny_size.json").write_text("{}")
    build_world_model(load_config(tiny_yaml, [f"model.wan.vae_path={stale}/vae", f"model.vlm.checkpoint_path="
                                              f"{stale}/vlm", f"model.wan.text_encoder_path={stale}/text_encoder"]))
    assert json.loads((stale / "tiny_size.json").read_text())["vae"] == "random"
    (stale / "vae").rename(tmp_path / "foreign_vae")
    (stale / "vae").mkdir()
    (stale / "tiny_size.json").unlink()
    with pytest.raises(ModelLoadError, match="no tiny_size.json"):
        build_world_model(load_config(tiny_yaml, [f"model.wan.vae_path={stale}/vae", f"model.vlm.checkpoint_path="
                                                  f"{stale}/vlm", f"model.wan.text_encoder_path={stale}/text_encoder"]))
    from models import WorldModel

    with pytest.raises(ModelLoadError, match="no config.json"):
        WorldModel.from_pretrained(str(empty.parent / "nowhere"))


def test_wan_checkpoint_loads_and_a_partial_one_is_refused(tiny_yaml, tmp_path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file, save_file

    from models.sizes import TINY

    torch.manual_seed(3)
    wan = WanTransformer3DModel(**TINY.wan)
    wan.save_pretrained(tmp_path / "transformer")  # a diffusers pipeline root holds transformer/
    (tmp_path / "model_index.json").write_text("{}")
    model, _ = build_world_model(load_config(tiny_yaml, [f"model.wan.checkpoint_path={tmp_path}"]))
    assert all(torch.equal(v, model.video.state_dict()[k]) for k, v in wan.state_dict().items())
    weights = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    del state["proj_out.weight"]
    save_file(state, weights)
    with pytest.raises(ModelLoadError, match=r"lacks weights .*proj_out.weight"):
        build_world_model(load_config(tiny_yaml, [f"model.wan.checkpoint_path={tmp_path}"]))


def test_prediction_figures(tiny):
    from models.report import prediction_figures

    model, encoders, inputs = tiny
    pred = model.sample(inputs, "joint", num_steps=1, generator=torch.Generator().manual_seed(9))
    video = encoders.decode_video(inputs.video_latents)
    grid, fig = prediction_figures(video, encoders.decode_video(pred.video_latents), inputs.actions,
                                   pred.actions)
    assert grid.shape == (3, 4 * 64, 5 * 64) and 0 <= float(grid.min()) and float(grid.max()) <= 1
    assert torch.equal(grid[:, :64], (video[0].permute(1, 2, 0, 3).reshape(3, 64, 5 * 64) + 1) / 2)
    assert len(fig.axes) == 4


def test_noise_seeds_make_losses_independent_of_batch_layout(tiny):
    """With per-sample seeds, a batch of 2 on one rank and 1 + 1 on two ranks see the same noise,
    so the mean loss over the samples is the same: the basis of exact multi-process parity."""
    model, _, inputs = tiny
    seeds = torch.tensor([11, 12])
    whole = model(inputs.replace(noise_seeds=seeds))
    halves = []
    for i in range(2):
        part = inputs.replace(**{k: v[i:i + 1] for k, v in inputs.tensors().items()})
        halves.append(model(part.replace(noise_seeds=seeds[i:i + 1])))
    for key in ("video_loss", "action_loss"):
        split = (getattr(halves[0], key) + getattr(halves[1], key)) / 2
        assert float(getattr(whole, key)) == pytest.approx(float(split), rel=1e-5)
    again = model(inputs.replace(noise_seeds=seeds))
    assert float(again.loss.detach()) == float(whole.loss.detach())
    other = model(inputs.replace(noise_seeds=seeds + 100))
    assert float(other.loss.detach()) != float(whole.loss.detach())


def test_training_from_a_latent_cache_builds_only_the_vae(tiny_yaml, tiny, tmp_path, caplog):
    """dataset.cache_dir provides video latents, text embeddings and VLM features: umT5 and Qwen3-VL
    (with their tokenizers / image processor) are not built, and say so once; a cached batch encodes
    and decodes (validation pictures) with the same VAE; a raw batch is refused naming the key;
    asking for every part (what data.build_cache and inference do) builds them all, the same weights."""
    from data.build_cache import cache_encoders
    from models.encoders import MissingFrozenPart

    _, full, inputs = tiny
    cached_cfg = load_config(tiny_yaml, [f"dataset.cache_dir={tmp_path}/cache"])
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="models.build"):
        model, encoders = build_world_model(cached_cfg)
    assert ("dataset.cache_dir provides text embeddings and VLM features: the umT5 text encoder and Qwen3-VL "
            "are not loaded") in caplog.text
    assert (encoders.text_encoder, encoders.tokenizer, encoders.vlm, encoders.vlm_tokenizer,
            encoders.image_processor) == (None,) * 5
    assert list(encoders.parts()) == ["vae"] and encoders.modules() == [encoders.vae]
    assert encoders.to("cpu").resident() == []
    torch.manual_seed(0)
    plain, _ = build_world_model(load_config(tiny_yaml))  # the model's init does not depend on the parts built
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items())
    batch = DataBatch(**{k: getattr(inputs, k) for k in ("video_latents", "text_embeds", "text_mask", "vlm_features",
                                                         "vlm_mask", "state", "actions")})
    out = encoders.encode(batch)
    assert all(getattr(out, k) is v for k, v in batch.tensors().items())
    assert torch.equal(encoders.decode_video(batch.video_latents), full.decode_video(batch.video_latents))
    raw = DataBatch(video=torch.zeros(1, 5, 3, 64, 64), instruction=["open the drawer"], actions=batch.actions[:1])
    with pytest.raises(MissingFrozenPart, match="no text_embeds but the umT5 text encoder was not loaded because "
                                                "dataset.cache_dir provides text embeddings"):
        encoders.encode(raw)
    with pytest.raises(MissingFrozenPart, match="no vlm_features but Qwen3-VL was not loaded because "
                                                "dataset.cache_dir provides VLM features"):
        encoders.encode_vlm(raw.video[:, 0], raw.instruction)
    every = cache_encoders(cached_cfg, "cpu")  # the cache being built may be the one cache_dir names
    assert list(every.parts()) == ["vae", "text_encoder", "vlm"]
    again = every.encode(DataBatch(video=torch.zeros(1, 5, 3, 64, 64), instruction=["open the drawer"]))
    assert torch.equal(again.text_embeds[0], inputs.text_embeds[1])
    # the config files of the parts not built are still checked at start
    with pytest.raises(ModelLoadError, match="model.vlm.checkpoint_path: .* does not exist"):
        build_world_model(load_config(tiny_yaml, [f"dataset.cache_dir={tmp_path}/cache",
                                                  f"model.vlm.checkpoint_path={tmp_path}/nowhere"]))
    with pytest.raises(ValueError, match="holds 'vae'"):
        build_world_model(cached_cfg, frozen_parts=("text_encoder",))


def test_the_depth_of_a_fresh_model_is_set_by_model_wan_num_layers(tiny_yaml, tiny, tmp_path):
    """Every expert gets the depth (one joint attention per layer); a checkpoint keeps its own."""
    _, _, inputs = tiny
    model, _ = build_world_model(load_config(tiny_yaml, ["model.wan.num_layers=3"]))
    assert (len(model.video.blocks), len(model.action_expert.layers), len(model.und_expert.layers)) == (3, 3, 3)
    assert model.spec["wan"]["num_layers"] == 3  # what a saved model folder records
    assert math.isfinite(model(inputs, generator=torch.Generator().manual_seed(9)).loss.item())
    with pytest.raises(ModelLoadError, match="model.wan.num_layers is 3 but model.wan.checkpoint_path is set"):
        build_world_model(load_config(tiny_yaml, ["model.wan.num_layers=3", f"model.wan.checkpoint_path={tmp_path}"]))


def test_the_heads_of_a_fresh_model_are_set_by_model_wan_num_attention_heads(tiny_yaml, tiny, tmp_path):
    """4 heads of 16 at the tiny width 64 (2 of 32 in the size table): the same weights, a different
    attention in every joint layer; widths that do not split into RoPE's three axes are refused."""
    _, _, inputs = tiny
    two, _ = build_world_model(load_config(tiny_yaml))
    four, _ = build_world_model(load_config(tiny_yaml, ["model.wan.num_attention_heads=4"]))
    assert (four.heads, four.video.config.attention_head_dim) == (4, 16)
    assert four.spec["wan"]["num_attention_heads"] == 4  # what a saved model folder records
    four.load_state_dict(two.state_dict())  # every weight has the same shape
    loss_two = two(inputs, generator=torch.Generator().manual_seed(9)).loss
    loss_four = four(inputs, generator=torch.Generator().manual_seed(9)).loss
    assert math.isfinite(loss_four.item()) and abs(loss_four.item() - loss_two.item()) > 1e-6
    with pytest.raises(ModelLoadError, match="num_attention_heads is 3: the tiny size's width 64 must split"):
        build_world_model(load_config(tiny_yaml, ["model.wan.num_attention_heads=3"]))
    with pytest.raises(ModelLoadError, match="num_attention_heads is 16: .* at least 6"):
        build_world_model(load_config(tiny_yaml, ["model.wan.num_attention_heads=16"]))
    with pytest.raises(ModelLoadError, match="model.wan.num_attention_heads is 4 but model.wan.checkpoint_path is set"):
        build_world_model(load_config(tiny_yaml, ["model.wan.num_attention_heads=4",
                                                  f"model.wan.checkpoint_path={tmp_path}"]))


def test_absolute_video_positions_start_as_the_model_without_them_and_then_place_tokens(tiny_yaml, tiny, tmp_path):
    """model.absolute_video_positions: at build the projection is zero and draws no random number, so the
    model is the one without it (the same loss, bit for bit); its gradient is not zero; a checkpoint without
    it fine-tunes into it with the projection at zero, reported missing; once trained it
    gives every cell of the latent grid its own embedding, the same in every latent frame; the key is
    saved with the model; the projection goes to AdamW (a position table, optim/routing.py)."""
    from checkpoint.finetune import load_finetune_weights
    from models import WorldModel
    from optim.routing import split_params

    _, _, inputs = tiny
    torch.manual_seed(0)
    plain, _ = build_world_model(load_config(tiny_yaml))
    torch.manual_seed(0)
    placed, _ = build_world_model(load_config(tiny_yaml, ["model.absolute_video_positions=true"]))
    assert plain.video_positions is None and tuple(placed.video_positions.weight.shape) == (64, 24)
    loss_plain = plain(inputs, generator=torch.Generator().manual_seed(3)).loss
    loss_placed = placed(inputs, generator=torch.Generator().manual_seed(3)).loss
    assert loss_placed.item() == loss_plain.item()
    loss_placed.backward()
    assert float(placed.video_positions.weight.grad.abs().sum()) > 0
    plain.save_pretrained(tmp_path / "plain")  # fine-tuned from a checkpoint without it: zero, reported missing
    report = load_finetune_weights(placed, str(tmp_path / "plain"))
    assert report.missing == ["video_positions.weight"] and not report.unexpected
    assert float(placed.video_positions.weight.detach().abs().sum()) == 0.0
    with torch.no_grad():
        placed.video_positions.weight.normal_()
    table = placed.video_positions(2, 3, 4)[0]  # 2 frames of a 3x4 grid
    assert table.shape == (24, 64) and torch.equal(table[:12], table[12:])
    assert torch.cdist(table[:12], table[:12]).add(torch.eye(12) * 1e9).min() > 1e-3  # 12 distinct cells
    muon, adamw = split_params(placed.named_parameters())
    assert "video_positions.weight" in dict(adamw) and "video_positions.weight" not in dict(muon)
    placed.save_pretrained(tmp_path / "placed")
    loaded = WorldModel.from_pretrained(str(tmp_path / "placed"))
    assert torch.equal(loaded.video_positions.weight, placed.video_positions.weight)
