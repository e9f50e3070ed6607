"""Our WorldModel computes Motus's function: Motus's own code, run at the tiny dims by
tests/fixtures/make_motus_fixture.py, wrote a checkpoint (`tests/fixtures/motus_tiny/`, bf16,
`{'module': ...}`, duplicate keys, tiny Qwen3-VL weights) and its outputs for fixed inputs
(`motus_tiny_io.safetensors`). Here the checkpoint goes through our converter and fine-tune path
and our forward and Euler sampler must match Motus's within 1e-4 of the largest output (fp32).
"""
import json
import logging
import os

import pytest
import torch
from safetensors import safe_open

from checkpoint.finetune import FinetuneError, load_finetune_weights
from models.convert_motus import MotusConvertError, convert_for_model, main as convert_main
from models.world_model import WorldModel
from tests.helpers import metrics, train
from recipe.config import load_config
from utils.batch import ModelBatch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
MOTUS_DIR = os.path.join(FIXTURES, "motus_tiny")
TINY = os.path.join(REPO, "configs", "tiny.yaml")
NO_VAE = ["model.wan.vae_path=null"]  # the tiny VAE's config from the size table: no assets needed
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def io():
    with safe_open(os.path.join(FIXTURES, "motus_tiny_io.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def tiny_model(*overrides):
    from models.folder import model_spec_from_config
    cfg = load_config(TINY, NO_VAE + list(overrides))
    torch.manual_seed(0)
    return WorldModel(model_spec_from_config(cfg)).eval()


@pytest.fixture(scope="module")
def model():
    m = tiny_model()
    report = load_finetune_weights(m, MOTUS_DIR)
    assert not report.missing and not report.unexpected  # a fine-tune-mode checkpoint fills every tensor
    return m


def inputs(io, und_mask=False):
    """The fixture's conditioning as a ModelBatch (with the clean latents; velocity reads the noisy ones it is given)."""
    features, mask = io["vlm_features"], None
    if und_mask:
        mask = io["vlm_mask"]
        # padding must not matter: fill it with values Motus never saw
        features = torch.where(~mask[..., None], 100 * torch.randn_like(features), features)
    return ModelBatch(video_latents=io["x_video"], state=io["state"], text_embeds=io["text_embeds"],
                      text_mask=io["text_mask"], vlm_features=features, vlm_mask=mask)


def assert_close(ours, motus, what):
    err = (ours.float() - motus).abs().max() / motus.abs().max()
    assert err < TOLERANCE, f"{what}: max |ours - Motus| is {err:.2e} of the largest output"


@torch.no_grad()
@pytest.mark.parametrize("k", [0, 1, 2])
def test_forward_matches_motus(model, io, k):
    data, _ = io
    video, actions = model.velocity(data["x_video"], data[f"forward{k}_s_video"], data["x_action"],
                                    data[f"forward{k}_s_action"], inputs(data))
    assert_close(video, data[f"forward{k}_video"], "video velocity")
    assert_close(actions, data[f"forward{k}_actions"], "action velocity")


@torch.no_grad()
def test_masked_und_padding_equals_motus_without_the_padding(model, io):
    """We mask the understanding tokens' padding in the joint attention: the outputs are Motus's
    on the unpadded tokens, whatever the padded positions hold."""
    data, _ = io
    video, actions = model.velocity(data["x_video"], data["forward0_s_video"], data["x_action"],
                                    data["forward0_s_action"], inputs(data, und_mask=True))
    assert_close(video, data["trimmed_video"], "video velocity")
    assert_close(actions, data["trimmed_actions"], "action velocity")


@torch.no_grad()
def test_joint_euler_sampling_matches_motus(model, io):
    data, meta = io
    seed, steps = int(meta["euler_seed"]), int(meta["euler_steps"])
    g = torch.Generator().manual_seed(seed)  # the noise our sampler draws is the noise Motus started from
    assert torch.equal(torch.randn(data["x_video"].shape, generator=g)[:, :, 1:], data["euler_video0"][:, :, 1:])
    assert torch.equal(torch.randn(data["x_action"].shape, generator=g), data["euler_actions0"])
    x = inputs(data).replace(video_latents=data["x_video"][:, :, :1])
    out = model.sample(x, "joint", num_steps=steps, generator=torch.Generator().manual_seed(seed))
    assert_close(out.video_latents, data["euler_video"], "sampled video latents")
    assert_close(out.actions, data["euler_actions"], "sampled actions")


def test_position_table_is_motus_and_loaded_one_wins(model):
    fresh = tiny_model("model.action_expert.position_scale=1.0")  # the default; tiny.yaml sets 0.2
    table = fresh.action_expert.positions
    assert "action_expert.positions" in fresh.state_dict()  # persistent: exports and checkpoints carry it
    assert table.abs().max() == 1.0  # Motus's amplitude
    assert torch.equal(tiny_model().action_expert.positions, 0.2 * table)
    loaded = model.action_expert.positions  # tiny.yaml's 0.2 does not apply to a loaded table
    assert torch.equal(loaded, table.bfloat16().float())  # Motus's bf16-rounded table, as saved
    assert not torch.equal(loaded, table)


def test_converter_writes_a_loadable_export(tmp_path, io, capsys):
    out = str(tmp_path / "export")
    convert_main([MOTUS_DIR, "--config", TINY, "--out", out, *NO_VAE])
    printed = capsys.readouterr().out
    assert "the frozen Qwen3-VL" in printed and "duplicates registered by Motus's wrapper modules" in printed
    exported = WorldModel.from_pretrained(out).eval()  # a fine-tune-mode checkpoint converts completely
    data, _ = io
    with torch.no_grad():
        video, actions = exported.velocity(data["x_video"], data["forward1_s_video"], data["x_action"],
                                           data["forward1_s_action"], inputs(data))
    assert_close(video, data["forward1_video"], "video velocity")
    assert_close(actions, data["forward1_actions"], "action velocity")
    fresh = tiny_model()
    report = load_finetune_weights(fresh, out)
    assert not report.missing
    with pytest.raises(SystemExit, match="not empty"):  # never overwrite a folder unasked
        convert_main([MOTUS_DIR, "--config", TINY, "--out", out, *NO_VAE])


def test_converter_on_a_fresh_clone_makes_the_tiny_parts_as_training_does(tmp_path, capsys):
    """No assets yet (a fresh clone): the converter makes the synthetic data and the tiny frozen parts,
    the VAE fitted as training fits it (a shortened fit here: 2 + 2 steps), then converts."""
    from models import tiny_assets

    assets, out = tmp_path / "assets", str(tmp_path / "export")
    fresh = [f"dataset.dataset_dir={assets}/synthetic", f"model.wan.text_encoder_path={assets}/tiny/text_encoder",
             f"model.wan.vae_path={assets}/tiny/vae", f"model.vlm.checkpoint_path={assets}/tiny/vlm",
             "model.tiny_vae_fit.frame_steps=2", "model.tiny_vae_fit.clip_steps=2"]
    convert_main([MOTUS_DIR, "--config", TINY, "--out", out, *fresh])
    stamp = json.loads((assets / "tiny" / tiny_assets.STAMP).read_text())
    # fitted to the training videos for the recipe's steps: training with the same recipe will not rebuild it
    assert (stamp["vae"], stamp["fit"]) == (tiny_assets.VAE_FIT, {"frame_steps": 2, "clip_steps": 2, "videos": 64})
    assert sorted(os.listdir(assets / "tiny")) == ["text_encoder", tiny_assets.STAMP, "vae", "vlm"]
    report = load_finetune_weights(tiny_model(), out)
    assert not report.missing and not report.unexpected


def test_a_missing_part_is_one_message_not_a_traceback(tmp_path):
    nowhere = tmp_path / "nowhere"  # not the tiny layout: nothing is generated there
    with pytest.raises(SystemExit) as e:
        convert_main([MOTUS_DIR, "--config", TINY, "--out", str(tmp_path / "o"), f"model.wan.vae_path={nowhere}"])
    assert str(e.value).startswith(f"convert_motus failed: model.wan.vae_path: '{nowhere}' does not exist (expected")
    assert not os.path.exists(tmp_path / "o")


def test_dims_that_do_not_fit_name_the_key_and_both_shapes(tmp_path):
    with pytest.raises(SystemExit) as e:
        convert_main([MOTUS_DIR, "--config", TINY, "--out", str(tmp_path / "o"), *NO_VAE, "common.action_dim=5"])
    assert "'action_expert.input_encoder.action_encoder.0.weight' (ours 'action_expert.action_encoder.0.weight'): " \
           "checkpoint (64, 4), config (64, 5)" in str(e.value)
    assert not os.path.exists(tmp_path / "o")
    with pytest.raises(FinetuneError, match=r"checkpoint \(64, 4\), config \(64, 5\)"):
        load_finetune_weights(tiny_model("common.action_dim=5"), MOTUS_DIR)


def pretrain_mode_checkpoint(tmp_path):
    """Motus stage 2 as its ActionEncoder holds it: no state encoder, no registers, the table over
    the chunk alone (derived from the fine-tune-mode fixture)."""
    sd = torch.load(os.path.join(MOTUS_DIR, "mp_rank_00_model_states.pt"), weights_only=True)["module"]
    out = {}
    for k, v in sd.items():
        if "input_encoder.state_encoder." in k or k.endswith("action_expert.registers"):
            continue
        out[k] = v[:, :8] if k.endswith("input_encoder.pos_embedding") else v
    # the layout of Motus's own training checkpoints (accelerate + DeepSpeed), with its config.json beside
    os.makedirs(tmp_path / "stage2" / "pytorch_model")
    torch.save({"module": out}, tmp_path / "stage2" / "pytorch_model" / "mp_rank_00_model_states.pt")
    (tmp_path / "stage2" / "config.json").write_text('{"common": {"action_dim": 4}, "action_expert": {"norm_eps": 1e-6}}')
    return str(tmp_path / "stage2")


def test_pretrain_checkpoint_into_finetune_starts_the_action_io_fresh(tmp_path, caplog, model):
    path = pretrain_mode_checkpoint(tmp_path)
    fresh = tiny_model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="checkpoint.finetune"):
        report = load_finetune_weights(fresh, path)
    assert "state encoder, action encoder, registers, position table and action decoder start fresh" in caplog.text
    # what no shape shows, from the config.json Motus's trainer writes beside its checkpoints
    assert "action_expert.norm_eps 1e-06, the config model.action_expert.norm_eps 1e-05" in caplog.text
    starts_fresh = {"action_expert.registers", "action_expert.positions", "action_expert.out_modulation",
                    "action_expert.proj_out.weight", "action_expert.proj_out.bias"}
    assert starts_fresh <= set(report.missing)
    assert all(k.startswith(("action_expert.state_encoder.", "action_expert.action_encoder."))
               for k in set(report.missing) - starts_fresh)
    for k in report.missing:
        assert torch.equal(fresh.state_dict()[k], before[k])
    for k in report.loaded:
        assert torch.equal(fresh.state_dict()[k], model.state_dict()[k])
    # pretrain mode takes all of it; a fine-tune-mode checkpoint does not go into pretrain mode
    pretrain = tiny_model("model.mode=pretrain")
    assert not load_finetune_weights(pretrain, path).missing
    with pytest.raises(MotusConvertError, match="fine-tune-mode Motus checkpoint"):
        convert_for_model(MOTUS_DIR, tiny_model("model.mode=pretrain"))


def test_motus_video_loss_is_t_minus_1_over_t_of_ours(model, io):
    """Motus averages the video MSE over all latent frames with frame 0 zeroed in prediction and
    target; ours over the noisy frames only."""
    data, _ = io
    batch = inputs(data).replace(actions=data["x_action"], noise_seeds=torch.tensor([3, 4]))
    with torch.no_grad():
        ours = model(batch).video_loss
        from models.flow import _draw_noise_per_sample, add_noise
        s_v, s_a, eps_v, eps_a = _draw_noise_per_sample(data["x_video"], data["x_action"],
                                                        model.settings.time_distribution, batch.noise_seeds)
        x_v = add_noise(data["x_video"], eps_v, s_v)
        x_v[:, :, :1] = data["x_video"][:, :, :1]
        pred, _ = model.velocity(x_v, s_v, add_noise(data["x_action"], eps_a, s_a), s_a, batch)
        target = eps_v - data["x_video"]
        pred[:, :, :1], target[:, :, :1] = 0, 0
        motus = torch.nn.functional.mse_loss(pred, target)
    frames = data["x_video"].shape[2]
    torch.testing.assert_close(motus, ours * (frames - 1) / frames, rtol=1e-5, atol=0)


def test_train_starts_from_a_motus_folder(tmp_path):
    result = train(tmp_path, 2, "from_motus", [f"finetune.checkpoint_path={MOTUS_DIR}"])
    assert "tensors converted" in result.stdout + result.stderr
    records = metrics(tmp_path, "from_motus")
    assert [r["step"] for r in records if "loss" in r][-1] == 6
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
