"""Export (`python -m checkpoint.export`) and fine-tune loading, with the real tiny WorldModel.

The checkpoint is written the way DeepSpeed writes one under ZeRO: the module's tensors are
views of one flat buffer in `engine/mp_rank_00_model_states.pt` (which safetensors refuses
as it is), beside the trainer's config.yaml, norm_stats.json and COMPLETE marker.
"""
import json
import logging
import os

import pytest
import torch

from recipe.config import load_config, save_config
from checkpoint.export import export_checkpoint, main
from models.folder import ExportError, model_spec_from_config, parse_size
from checkpoint.finetune import FinetuneError, load_finetune_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_ACTION_DIM = r"action_expert\.(action_encoder\.0|proj_out)\..*"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    """The tiny recipe, its VAE in a local folder: export reads the VAE's config from there. Its other
    parts are the repository's assets/tiny, made here as training makes them (a no-op once made) so
    that the file does not depend on another test having trained first."""
    from diffusers import AutoencoderKLWan

    from models.sizes import get_size
    from recipe.generated import ensure_generated_inputs
    recipe = os.path.join(REPO, "configs", "tiny.yaml")
    ensure_generated_inputs(load_config(recipe))
    vae = str(tmp_path_factory.mktemp("assets") / "vae")
    AutoencoderKLWan(**get_size("tiny").vae).save_pretrained(vae)
    return load_config(recipe, [f"model.wan.vae_path={vae}"])


def world_model(cfg, seed, **spec_changes):
    from models.world_model import WorldModel
    spec = {**model_spec_from_config(cfg), **spec_changes}
    torch.manual_seed(seed)
    model = WorldModel(spec)
    with torch.no_grad():  # no zero-initialised tensor: every value must travel
        for p in model.parameters():
            p.normal_()
    return model


def write_checkpoint(state, cfg, path, complete=True):
    os.makedirs(os.path.join(path, "engine"))
    flat = torch.cat([v.reshape(-1) for v in state.values()])
    views, offset = {}, 0
    for k, v in state.items():
        views[k] = flat[offset:offset + v.numel()].view(v.shape)
        offset += v.numel()
    torch.save({"module": views, "global_steps": 3}, os.path.join(path, "engine", "mp_rank_00_model_states.pt"))
    save_config(cfg, os.path.join(path, "config.yaml"))
    with open(os.path.join(path, "norm_stats.json"), "w") as f:
        json.dump({"action": {"mean": [0.5, -1.0, 2.0, 0.0]}}, f)
    if complete:
        seal_checkpoint(path)
    return path


def seal_checkpoint(path):
    """The manifest of every file and the COMPLETE marker, as Checkpointer ends a save."""
    from checkpoint.checkpointer import NOT_LISTED, seal
    from checkpoint.manifest import digest_files, list_files

    step = int(path.rstrip("/").rsplit("_", 1)[1])
    seal(path, step, digest_files(path, list_files(path, NOT_LISTED)), {"weights_finite": True, "loss_finite": True}, 1)


@pytest.fixture(scope="module")
def trained(cfg, tmp_path_factory):
    model = world_model(cfg, seed=1)
    path = write_checkpoint(model.state_dict(), cfg, str(tmp_path_factory.mktemp("run") / "checkpoint_step_3"))
    return model.state_dict(), path


def assert_same(state, expected):
    assert set(state) == set(expected)
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


def test_export_round_trip_is_exact(cfg, trained, tmp_path):
    from models.world_model import WorldModel
    expected, ckpt = trained
    out = export_checkpoint(ckpt, str(tmp_path / "export"))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "norm_stats.json"]
    with open(os.path.join(out, "norm_stats.json")) as f:
        assert json.load(f)["action"]["mean"] == [0.5, -1.0, 2.0, 0.0]
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["common"]["action_chunk_size"] == 8 and config["action_dim"] == 4
    assert_same(WorldModel.from_pretrained(out).state_dict(), expected)
    fresh = world_model(cfg, seed=2)
    report = load_finetune_weights(fresh, out, [])
    assert sorted(report.loaded) == sorted(expected) and not report.missing and not report.unexpected
    assert_same(fresh.state_dict(), expected)


def test_sharded_export_through_the_command(cfg, trained, tmp_path, capsys):
    from models.world_model import WorldModel
    expected, ckpt = trained
    out = str(tmp_path / "export")
    main([ckpt, out, "--max-shard-size", "200KB"])
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) >= 3 and "model.safetensors" not in files
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert set(weight_map) == set(expected)
    for shard in shards:  # within the limit, unless one tensor alone is larger
        names = [k for k, f in weight_map.items() if f == shard]
        nbytes = sum(expected[k].numel() * expected[k].element_size() for k in names)
        assert nbytes <= 200_000 or len(names) == 1, shard
    assert_same(WorldModel.from_pretrained(out).state_dict(), expected)
    fresh = world_model(cfg, seed=2)
    load_finetune_weights(fresh, out, [])
    assert_same(fresh.state_dict(), expected)
    assert "exported" in capsys.readouterr().out


def test_export_refuses_a_non_empty_folder_unless_overwrite(trained, tmp_path):
    _, ckpt = trained
    out = str(tmp_path / "export")
    export_checkpoint(ckpt, out, max_shard_bytes=200_000)
    with pytest.raises(ExportError, match="not empty; pass --overwrite"):
        export_checkpoint(ckpt, out)
    open(os.path.join(out, "README.md"), "w").close()
    export_checkpoint(ckpt, out, overwrite=True)  # one file now: no stale shard may remain
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "norm_stats.json"]
    with pytest.raises(SystemExit, match="has no config.yaml"):
        main([str(tmp_path), str(tmp_path / "other")])


def test_finetune_from_a_training_checkpoint_is_exact(cfg, trained):
    expected, ckpt = trained
    fresh = world_model(cfg, seed=2)
    report = load_finetune_weights(fresh, ckpt, [])
    assert len(report.loaded) == len(expected)
    assert_same(fresh.state_dict(), expected)


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "nowhere", "does not exist; expected a checkpoint_step_N folder"),
    (lambda d: (d / "file.pt").write_bytes(b"x") and d / "file.pt", "is a file"),
    (lambda d: d, "holds no weights"),
    (lambda d: (d / "model.safetensors").write_bytes(b"garbage") and d, "could not read the weights"),
])
def test_finetune_bad_path_is_a_clear_error(cfg, tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(FinetuneError, match=message) as err:
        load_finetune_weights(world_model(cfg, seed=2), str(path), [])
    assert str(path) in str(err.value)


def test_finetune_refuses_an_interrupted_or_unrelated_checkpoint(cfg, tmp_path):
    ckpt = write_checkpoint(world_model(cfg, seed=1).state_dict(), cfg, str(tmp_path / "checkpoint_step_5"),
                            complete=False)
    with pytest.raises(FinetuneError, match="no COMPLETE marker"):
        load_finetune_weights(world_model(cfg, seed=2), ckpt, [])
    other = torch.nn.Sequential(torch.nn.Linear(3, 3))
    seal_checkpoint(ckpt)
    with pytest.raises(FinetuneError, match="shares no tensor with the model"):
        load_finetune_weights(other, ckpt, [])


def test_new_action_dim_needs_an_allow_pattern(cfg, trained, caplog):
    expected, ckpt = trained
    model = world_model(cfg, seed=2, action_dim=6)
    key, hidden = "action_expert.proj_out.weight", expected["action_expert.proj_out.weight"].shape[1]
    with pytest.raises(FinetuneError) as err:
        load_finetune_weights(model, ckpt, [])
    assert f"{key}: checkpoint (4, {hidden}), model (6, {hidden})" in str(err.value)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="checkpoint.finetune"):
        report = load_finetune_weights(model, ckpt, [NEW_ACTION_DIM])
    assert sorted(k for k, _, _ in report.skipped) == [
        "action_expert.action_encoder.0.weight", "action_expert.proj_out.bias", "action_expert.proj_out.weight"]
    assert ("action_expert.proj_out.bias", (4,), (6,)) in report.skipped
    skipped = {k for k, _, _ in report.skipped}
    for k, v in model.state_dict().items():  # skipped keys keep their fresh init, the rest is loaded
        assert torch.equal(v, before[k] if k in skipped else expected[k]), k
    assert "shape changed, allowed (fresh init): action_expert.proj_out.bias (4,) -> (6,)" in caplog.text


def test_missing_and_unexpected_keys_are_reported(cfg, tmp_path, caplog):
    model = world_model(cfg, seed=1)
    state = model.state_dict()
    dropped = "action_expert.registers"
    saved = {k: v for k, v in state.items() if k != dropped}
    saved["old_head.weight"] = torch.ones(2)
    ckpt = str(tmp_path / "checkpoint_step_1")
    write_checkpoint(saved, cfg, ckpt)
    fresh = world_model(cfg, seed=2)
    with caplog.at_level(logging.WARNING, logger="checkpoint.finetune"):
        report = load_finetune_weights(fresh, ckpt, [])
    assert report.missing == [dropped] and report.unexpected == ["old_head.weight"]
    assert f"missing (fresh init): {dropped}" in caplog.text
    assert "unexpected (ignored): old_head.weight" in caplog.text


def test_parse_size():
    assert parse_size("5GB") == 5 * 10 ** 9 and parse_size("2GiB") == 2 * 2 ** 30
    assert parse_size("200KB") == 200_000 and parse_size("1024") == 1024
    with pytest.raises(ExportError, match="expected a size such as 5GB"):
        parse_size("5 parsecs")


def test_finetune_and_export_verify_the_weights_file(cfg, trained, tmp_path):
    """A checkpoint with a manifest: a damaged weights file stops the fine-tune and the export with
    the file's name; damage elsewhere (optimizer state they do not read) does not."""
    import shutil

    _, source = trained
    ckpt = str(tmp_path / "checkpoint_step_3")
    shutil.copytree(source, ckpt)
    with open(os.path.join(ckpt, "engine", "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "wb") as f:
        f.write(b"optimizer state")
    seal_checkpoint(ckpt)
    load_finetune_weights(world_model(cfg, seed=2), ckpt, [])  # whole: loads
    with open(os.path.join(ckpt, "engine", "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "r+b") as f:
        f.write(b"X")  # damage the state a fine-tune never reads
    load_finetune_weights(world_model(cfg, seed=2), ckpt, [])
    weights = os.path.join(ckpt, "engine", "mp_rank_00_model_states.pt")
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) // 2)
        f.write(b"\x00" * 64)
    with pytest.raises(FinetuneError, match="mp_rank_00_model_states.pt: checksum mismatch"):
        load_finetune_weights(world_model(cfg, seed=2), ckpt, [])
    with pytest.raises(FinetuneError, match="fails verification"):
        export_checkpoint(ckpt, str(tmp_path / "out"))


def add_ema(ckpt, ema, updates=4):
    """The file a DDP / stage-0 run with training.ema writes beside its weights."""
    torch.save({"updates": updates, "weights": ema}, os.path.join(ckpt, "engine", "ema.pt"))
    seal_checkpoint(ckpt)  # the manifest lists it, as a save with training.ema writes it


@pytest.fixture(scope="module")
def trained_with_ema(cfg, tmp_path_factory):
    raw = world_model(cfg, seed=1).state_dict()
    ema = {k: v.clone() for k, v in world_model(cfg, seed=3).named_parameters()}
    path = write_checkpoint(raw, cfg, str(tmp_path_factory.mktemp("run_ema") / "checkpoint_step_3"))
    add_ema(path, ema)
    return raw, {**raw, **ema}, path


def test_ema_export_round_trip_and_finetune(cfg, trained_with_ema, tmp_path, capsys):
    """`--weights ema` writes the EMA set; the export says which set it holds; a fine-tune from it
    loads exactly the EMA; the default export is the raw set."""
    from models.world_model import WorldModel
    raw, ema, ckpt = trained_with_ema
    out = str(tmp_path / "ema")
    main([ckpt, out, "--weights", "ema"])
    assert "exported the ema weights of" in capsys.readouterr().out
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["weights"] == "ema"
    assert_same(WorldModel.from_pretrained(out).state_dict(), ema)
    fresh = world_model(cfg, seed=2)
    report = load_finetune_weights(fresh, out, [])
    assert len(report.loaded) == len(ema) and not report.missing
    assert_same(fresh.state_dict(), ema)
    default = export_checkpoint(ckpt, str(tmp_path / "raw"))
    assert_same(WorldModel.from_pretrained(default).state_dict(), raw)


def test_inference_weights_default_to_the_ema_and_say_so(cfg, trained, trained_with_ema, tmp_path):
    from checkpoint.finetune import inference_weights
    raw, ema, ckpt = trained_with_ema
    state, which, note = inference_weights(ckpt)
    assert which == "ema" and "EMA weights (--weights raw" in note and ckpt in note
    assert_same(state, ema)
    state, which, note = inference_weights(ckpt, weights="raw")
    assert which == "raw" and "also holds EMA weights" in note
    assert_same(state, raw)
    plain_raw, plain = trained
    state, which, note = inference_weights(plain)
    assert which == "raw" and "holds no EMA weights" in note
    with pytest.raises(FinetuneError, match="holds no EMA weights"):
        inference_weights(plain, weights="ema")
    exported = export_checkpoint(ckpt, str(tmp_path / "export"), weights="ema")
    state, which, note = inference_weights(exported)
    assert which == "ema" and "exported" in note
    assert_same(state, ema)
    with pytest.raises(FinetuneError, match="is an export of the ema weights"):
        inference_weights(exported, weights="raw")


def test_ema_export_errors(cfg, trained, tmp_path):
    _, plain = trained
    with pytest.raises(SystemExit, match="holds no EMA weights"):
        main([plain, str(tmp_path / "a"), "--weights", "ema"])
    raw = world_model(cfg, seed=1).state_dict()
    early = write_checkpoint(raw, cfg, str(tmp_path / "checkpoint_step_1"))
    add_ema(early, dict(world_model(cfg, seed=3).named_parameters()), updates=0)
    with pytest.raises(SystemExit, match="the EMA has had no update yet"):
        main([early, str(tmp_path / "b"), "--weights", "ema"])
    from checkpoint.finetune import inference_weights
    state, which, note = inference_weights(early)  # evaluation falls back to the raw weights, and says why
    assert which == "raw" and "its EMA has had no update yet" in note
    assert_same(state, raw)
