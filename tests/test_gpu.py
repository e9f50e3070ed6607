"""GPU-only checks (`pytest -m gpu`; skipped without CUDA): the first things a GPU run does that no
CPU test can reach. `bash scripts/gpu_check.sh` runs them and writes their outcome into its report."""
import json
import os
import sys

import pytest
import torch

from tests.helpers import losses, metrics, run_dir, sh, train

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = ["model.precision=bf16_mixed", "training.batch_size=2", "training.muon.ns_dtype=bfloat16"]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("optimizer", ["muon_adamw", "adamw"])
def test_one_process_nccl_zero2_bf16_trains_the_tiny_recipe(tmp_path, optimizer):
    """One process, NCCL, DeepSpeed ZeRO-2, bf16_mixed: the start-up agreement, the step and the
    checkpoint run, and the losses and gradient norms are finite numbers."""
    train(tmp_path, 1, optimizer, BF16 + [f"training.optimizer={optimizer}"])
    records = metrics(tmp_path, optimizer)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert all(torch.isfinite(torch.tensor([r["loss"], r["video_loss"], r["action_loss"], r["grad_norm"]])))
    assert os.path.isdir(os.path.join(run_dir(tmp_path, optimizer), "checkpoint_step_6"))


@pytest.mark.gpu
@needs_gpu
def test_bf16_resume_is_bit_identical_on_one_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
    train(tmp_path, 1, "full", BF16)
    ckpt = os.path.join(run_dir(tmp_path, "full"), "checkpoint_step_3")
    train(tmp_path, 1, "resumed", BF16 + [f"resume.checkpoint_path={ckpt}"])
    rewound = [p for p in os.listdir(run_dir(tmp_path, "full")) if "rewound" in p]
    assert rewound, "the first pass's records after step 3 are kept aside"
    with open(os.path.join(run_dir(tmp_path, "full"), rewound[0])) as f:
        first_pass = {json.loads(line)["step"]: json.loads(line)["loss"] for line in f}
    again = losses(metrics(tmp_path, "full"))
    assert first_pass == {s: again[s] for s in (4, 5, 6)}


@pytest.mark.gpu
@needs_gpu
def test_flash_attention_matches_sdpa_on_the_joint_attention():
    """models/joint.attention takes flash-attn on CUDA in bf16 without a mask; SDPA is the reference.
    Motus shapes: 360 video + 21 action + 160 understanding tokens, 24 heads of 128."""
    from models import joint

    if joint.flash_attn_func is None:
        pytest.skip("flash-attn is not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 541, 24, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    flash = joint.attention(q, k, v, None).float()
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float()).transpose(1, 2).flatten(2)
    err = (flash - sdpa).abs().max() / sdpa.abs().max()
    assert float(err) < 2e-2, float(err)  # bf16 inputs and output: 8 bits of mantissa


@pytest.mark.gpu
@needs_gpu
def test_bf16_newton_schulz_on_cuda_matches_cpu_float32():
    from optim.newton_schulz import orthogonalize

    gen = torch.Generator().manual_seed(0)
    for shape in [(4, 256, 256), (2, 512, 1024), (2, 1024, 384)]:
        g = torch.randn(*shape, generator=gen)
        ref = orthogonalize(g, (3.4445, -4.7750, 2.0315), 5, torch.float32)
        for method in ("standard", "gram"):
            got = orthogonalize(g.cuda(), (3.4445, -4.7750, 2.0315), 5, torch.bfloat16, method).float().cpu()
            rel = (got - ref).norm() / ref.norm()
            assert float(rel) < 8e-2, (shape, method, float(rel))  # bf16 rounding over 5 iterations
            # the same singular-value band as float32 (Muon's quintic keeps them near 0.7..1.2)
            assert float(torch.linalg.matrix_norm(got, ord=2).max()) < 1.3


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_says_no_gpu_on_a_cpu_machine(tmp_path):
    out = tmp_path / "gpu_check.json"
    r = sh("bash", "scripts/gpu_check.sh", "--out", str(out), env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "gpu_check: no GPU" in r.stderr and not out.exists()


def test_frozen_parts_move_to_the_device_only_when_a_batch_needs_them(tmp_path):
    """CPU stand-in for the GPU: the `meta` device (a move there is visible, nothing is computed).
    A batch from a latent cache moves no frozen part; a batch that needs text embeddings moves umT5."""
    from models import build_world_model
    from tests.helpers import config_from

    cfg = config_from(tmp_path, {"common": {"action_dim": 4, "state_dim": 4, "num_video_frames": 4},
                                 "model": {"size": "tiny", "wan": {"vae_path": None, "text_encoder_path": None},
                                           "vlm": {"checkpoint_path": None},
                                           "und_expert": {"vlm": {"input_dim": 32}}}})
    _, encoders = build_world_model(cfg)
    encoders.to("meta")
    cached = {"video_latents": torch.randn(2, 8, 2, 8, 8), "text_embeds": torch.randn(2, 16, 32),
              "text_mask": torch.ones(2, 16, dtype=torch.bool), "vlm_features": torch.randn(2, 6, 32),
              "actions": torch.randn(2, 8, 4), "instruction": ["a", "b"]}
    out = encoders.encode(cached)
    assert encoders.resident() == []
    assert all(p.device.type == "cpu" for m in encoders.modules() for p in m.parameters())
    assert all(out[k] is cached[k] for k in ("video_latents", "text_embeds", "vlm_features"))
    with pytest.raises(RuntimeError, match="meta"):  # umT5 reads a value back, which meta cannot give:
        encoders.encode_text(["open the drawer"])  # by then it has been moved, which is what counts here
    assert encoders.resident() == ["text_encoder"]
    assert all(p.device.type == "cpu" for p in encoders.vae.parameters())
