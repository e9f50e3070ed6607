"""Offline evaluation of a checkpoint (python -m inference.evaluate): loading from every folder kind,
figures checked against numbers computed here, baselines, determinism, the report's files."""
import json
import os

import numpy as np
import pytest
import torch

from helpers import train

EVAL_ARGS = ["--episodes", "1", "--modes", "policy,joint,inverse_dynamics", "--media", "1", "--steps", "2"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A run of the default recipe, 2 steps on one process (the tiny frozen parts and the synthetic data
    are the repository's assets/, built on first use as a user's first run builds them)."""
    tmp = tmp_path_factory.mktemp("infer_runs")
    train(tmp, 1, "infer", ["training.max_steps=2", "system.save_interval=2"], deepspeed=None)
    return os.path.join(str(tmp), "tiny", "infer")


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    from inference.load import load_checkpoint
    return load_checkpoint(tiny_checkpoint)


def test_a_run_folder_a_checkpoint_and_an_export_load_the_same_model(tiny_checkpoint, loaded, tmp_path):
    from checkpoint.export import export_checkpoint
    from inference.load import CheckpointError, load_checkpoint

    step = os.path.join(tiny_checkpoint, "checkpoint_step_2")
    assert loaded.checkpoint == step  # the run folder resolved through its `latest`
    exported = load_checkpoint(export_checkpoint(step, str(tmp_path / "export")))
    a, b = loaded.model.state_dict(), exported.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert exported.stats.to_dict() == loaded.stats.to_dict()
    assert loaded.weights == exported.weights == "raw"  # trained without training.ema: the raw set
    # raw observations need every frozen part, even when the recipe says it trained from a latent cache
    from_cache = load_checkpoint(tiny_checkpoint, overrides=[f"dataset.cache_dir={tmp_path}/cache"])
    assert from_cache.cfg.dataset.cache_dir and list(from_cache.encoders.parts()) == ["vae", "text_encoder", "vlm"]
    with pytest.raises(CheckpointError, match="holds no EMA weights"):
        load_checkpoint(tiny_checkpoint, weights="ema")
    with pytest.raises(CheckpointError, match="is not a folder"):
        load_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "checkpoint_step_9").mkdir()
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        load_checkpoint(str(tmp_path / "checkpoint_step_9"))


def test_a_run_folder_gives_its_newest_whole_checkpoint_as_resume_does(tiny_checkpoint, tmp_path, caplog):
    """The newest checkpoint (the one `latest` names) has a damaged weight file and a newer save was
    interrupted: inference takes the older whole one, the one `resume.checkpoint_path` takes, and
    says why; named by hand, the damaged and the interrupted ones are refused naming their folder."""
    import shutil

    from checkpoint.checkpointer import resolve_resume_path
    from inference.load import CheckpointError, resolve_checkpoint

    run = tmp_path / "run"
    good, newer, interrupted = (run / f"checkpoint_step_{n}" for n in (2, 4, 6))
    shutil.copytree(os.path.join(tiny_checkpoint, "checkpoint_step_2"), good)
    shutil.copytree(good, newer)
    (newer / "COMPLETE").write_text((good / "COMPLETE").read_text().replace("2\n", "4\n", 1))
    assert resolve_checkpoint(str(run)) == str(newer)  # whole: the newest is taken
    shutil.copytree(good, interrupted)
    os.remove(interrupted / "COMPLETE")
    (run / "latest").write_text("checkpoint_step_4\n")
    weights = max((p for p in newer.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))

    with caplog.at_level("WARNING"):
        assert resolve_checkpoint(str(run)) == str(good) == resolve_resume_path(str(run), str(run))
    assert f"checkpoint {newer} FAILS VERIFICATION" in caplog.text
    with pytest.raises(CheckpointError, match=f"'{newer}' fails verification: .*{weights.name}"):
        resolve_checkpoint(str(newer))
    with pytest.raises(CheckpointError, match=f"'{interrupted}' has no COMPLETE marker"):
        resolve_checkpoint(str(interrupted))
    shutil.rmtree(good)
    with pytest.raises(CheckpointError, match=f"'{run}': none of the 1 complete checkpoints .* passes verification"):
        resolve_checkpoint(str(run))
    shutil.rmtree(newer)
    with pytest.raises(CheckpointError, match=f"'{run}' holds no complete checkpoint_step_N folder"):
        resolve_checkpoint(str(run))


def test_action_errors_and_baselines_are_the_stated_numbers():
    from inference.metrics import action_errors, baselines

    true = np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 10
    pred = true + np.array([0.1, -0.2, 0.0, 0.3])
    e = action_errors(pred, true)
    assert e["mse_per_dim"] == pytest.approx([0.01, 0.04, 0.0, 0.09])
    assert e["mae"] == pytest.approx(0.15) and e["mse_per_step"] == pytest.approx([0.035] * 3)
    last = np.array([[1.0, 1, 1, 1], [2, 2, 2, 2]])
    b = baselines(true, last, mean_action=[0.0, 0, 0, 0])
    assert b["mean_action"]["mse"] == pytest.approx((true ** 2).mean())
    assert b["last_action"]["mae_per_step"][0] == pytest.approx(np.abs(true[:, 0] - last).mean())


def test_evaluate_reports_match_the_predictions_and_are_deterministic(tiny_checkpoint, loaded, tmp_path):
    from inference.evaluate import eval_dataset, main, sample_seed
    from inference.policy import Policy

    main(["--checkpoint", tiny_checkpoint, "--out", str(tmp_path / "a"), *EVAL_ARGS])
    main(["--checkpoint", tiny_checkpoint, "--out", str(tmp_path / "b"), *EVAL_ARGS])
    a = json.loads((tmp_path / "a" / "report.json").read_text())
    assert a == json.loads((tmp_path / "b" / "report.json").read_text())  # same seed, same figures
    assert a["checkpoint"] == os.path.abspath(os.path.join(tiny_checkpoint, "checkpoint_step_2"))
    assert a["config_hash"] == loaded.config_hash and a["seed"] == 0 and a["num_episodes"] == 1

    # recompute the policy figure of the first sample here, through the in-process policy
    dataset = eval_dataset(loaded.cfg, loaded.stats)
    windows = [w for w in dataset.val_windows() if w[0] < 1]
    assert a["num_samples"] == len(windows) > 0
    from data.stream import collate
    batch = collate([dataset.load(w) for w in windows])
    seeds = [sample_seed(0, dataset.episodes[i], c) for i, c in windows]
    policy = Policy(loaded)
    pred = policy.sample(policy.encoders.encode(batch), seeds, "policy", 2).actions.numpy()
    true = loaded.stats.unnormalize_action(batch.actions).numpy()
    assert a["modes"]["policy"]["actions"]["mse"] == pytest.approx(((pred - true) ** 2).mean(), rel=1e-5)
    ep = dataset.episodes[0]
    last = np.stack([ep.action[max(c - 1, 0)] for _, c in windows])
    assert a["baselines"]["last_action"]["mse"] == pytest.approx(((last[:, None] - true) ** 2).mean(), rel=1e-5)
    assert np.allclose(true, ep.action[[c + (k + 1) * 2 for _, c in windows for k in range(8)]].reshape(true.shape),
                       atol=1e-5)  # the truth is the recording, in robot units

    video = a["modes"]["joint"]["video"]
    assert set(video) == {"psnr", "psnr_per_frame", "latent_mse"} and len(video["psnr_per_frame"]) == 4
    recon = policy.encoders.decode_video(policy.encoders.encode_video(batch.video))
    mse = (recon[:, 1:].double() - batch.video[:, 1:].double()).pow(2).mean().item()
    assert a["video_baselines"]["vae_reconstruction"]["psnr"] == pytest.approx(10 * np.log10(4 / mse), abs=1e-4)
    files = set(os.listdir(tmp_path / "a")) | set(os.listdir(tmp_path / "a" / "samples"))
    assert {"report.md", "action_mse_per_step.png", "action_mse_per_dim.png", "video_psnr_per_frame.png",
            "sample0_joint.mp4", "sample0_policy_actions.png"} <= files
    import av
    with av.open(str(tmp_path / "a" / "samples" / "sample0_joint.mp4")) as c:
        frame = next(c.decode(video=0))
        assert (frame.width, frame.height) == (2 * 64 * 4, 64 * 4)  # true | predicted, 4x upscaled
    md = (tmp_path / "a" / "report.md").read_text()
    assert "baseline: last_action" in md and f"{a['modes']['policy']['actions']['mse']:.4g}" in md


def test_bad_arguments_exit_with_a_message(tiny_checkpoint, tmp_path):
    from inference.evaluate import main

    with pytest.raises(SystemExit, match="--modes 'policy,dance'"):
        main(["--checkpoint", tiny_checkpoint, "--out", str(tmp_path), "--modes", "policy,dance"])
    with pytest.raises(SystemExit, match="neither a checkpoint_step_N folder"):
        main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "out")])
