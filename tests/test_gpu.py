"""GPU-only checks (`pytest -m gpu`; skipped without CUDA): the first things a GPU run does that no
CPU test can reach. `bash scripts/gpu_check.sh` runs them and writes their outcome into its report."""
import json
import os
import sys
import time

import pytest
import torch

from tests.helpers import ROOT, losses, metrics, run_dir, sh, train

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


DETERMINISTIC_PRELUDE = """import runpy, sys, torch
torch.use_deterministic_algorithms(True, warn_only=True)
for backend in ("flash", "mem_efficient", "cudnn"):
    getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)
import models.joint
models.joint.flash_attn_func = None
"""


def deterministic_train_script(tmp_path):
    """train/train.py with a deterministic attention backward. The backward of SDPA's flash,
    memory-efficient and cuDNN kernels (and flash-attn's) accumulates with atomics, and
    use_deterministic_algorithms(warn_only=True) only warns about them: two runs of the same step would
    differ in the last bits. So the script selects SDPA's math backend, whose backward is plain matmuls
    and softmax (deterministic cuBLAS under CUBLAS_WORKSPACE_CONFIG), and takes flash-attn out of
    models/joint.py. warn_only stays for the frozen parts' forward, which is not differentiated: an op
    there without a deterministic CUDA kernel warns; the bit-identical losses are what the test asserts."""
    script = os.path.join(ROOT, "train", "train.py")
    path = tmp_path / "deterministic_train.py"
    path.write_text(f"import sys\nsys.path.insert(0, {ROOT!r})\n" + DETERMINISTIC_PRELUDE +
                    f"sys.argv[0] = {script!r}\nrunpy.run_path({script!r}, run_name='__main__')\n")
    return str(path)


@pytest.mark.gpu
@needs_gpu
def test_bf16_resume_is_bit_identical_on_one_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
    # cuDNN's autotuner may pick another convolution algorithm (other bits) in each process
    exact = BF16 + ["system.speed.cudnn_benchmark=false"]
    script = deterministic_train_script(tmp_path)
    train(tmp_path, 1, "full", exact, script=script)
    ckpt = os.path.join(run_dir(tmp_path, "full"), "checkpoint_step_3")
    train(tmp_path, 1, "resumed", exact + [f"resume.checkpoint_path={ckpt}"], script=script)
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


SMALL = ["common.video_height=128", "common.video_width=96", "common.num_video_frames=4",
         "model.action_expert.hidden_size=128", "model.und_expert.hidden_size=128", "model.und_expert.vlm.input_dim=64"]


def test_gpu_check_worker_path_runs_on_cpu(tmp_path, capsys):
    """The GPU check's whole path (main -> run_worker -> bench_rows -> engine_for -> measure) on the
    CPU: gloo, the tiny size at robotwin.yaml's settings with smaller frames and experts (--overrides:
    the full shapes and widths cost a minute of CPU steps and test no other line), one optimizer
    (Muon: each optimizer is a worker process of its own, 30 s of start-up on 2 cores, and the other
    runs the same lines), one batch size (2, so that tokens per second must count the batch), 1 timed
    step. Only the CUDA calls of its Device are skipped, so the memory columns are null, never stand-ins."""
    from benchmarks import gpu_check
    from models.build import vae_compression
    from models.sizes import get_size
    from models.memory_model import predict_peak

    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--device", "cpu", "--sizes", "tiny", "--optimizers", "muon_adamw", "--batches", "2",
                           "--steps", "1", "--out", str(out), "--overrides", *SMALL])
    report = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().out + json.dumps(report["rows"], indent=1)
    rows = report["rows"]
    assert report["overrides"] == SMALL
    assert [(r["optimizer"], r["gradient_checkpointing"], r["batch"]) for r in rows] == [
        ("muon_adamw", c, 2) for c in (True, False)]
    # an independent count of the tokens per sample from the config: Wan's 2x2 patches of the latents,
    # [state | chunk | registers], the VLM's merged image cells of one frame plus the prompt
    cfg = gpu_check.check_config("tiny", "muon_adamw", 2, SMALL)
    size, c = get_size("tiny"), cfg.common
    temporal, spatial = vae_compression(size.vae)
    video = (1 + c.num_video_frames // temporal) * (c.video_height // spatial // 2) * (c.video_width // spatial // 2)
    cell = size.vlm_vision["patch_size"] * size.vlm_vision["spatial_merge_size"]
    und = -(-c.video_height // cell) * -(-c.video_width // cell) + 40
    action = c.action_chunk_size + cfg.model.action_expert.num_registers + 1  # finetune: the state token
    for r in rows:
        assert r["expert_tokens"] == {"video": video, "action": action, "und": und}, r
        assert r["tokens_per_sample"] == video + action + und
        assert torch.isfinite(torch.tensor(r["loss"])) and r["step_s"] > 0
        # step_s is rounded to 0.1 ms in the row, tokens_per_s (rounded to 1) comes from the unrounded time
        tokens = r["tokens_per_sample"] * r["batch"]
        assert tokens / (r["step_s"] + 5e-5) - 0.5 <= r["tokens_per_s"] <= tokens / (r["step_s"] - 5e-5) + 0.5, r
        assert r["peak_gib"] is None and r["measured_over_predicted"] is None and r["mfu"] is None
        # the check's prediction is the memory model's own (memory_model.predict_peak rounds to 0.01 GiB)
        expected = predict_peak(gpu_check.check_config("tiny", r["optimizer"], 2, SMALL), r["batch"],
                                r["gradient_checkpointing"])
        assert r["predicted_peak_gib"] > 0 and abs(r["predicted_peak_gib"] - expected) <= 0.005 + 1e-9, (r, expected)
    s = report["summary"]
    assert s["workers_failed"] == [] and s["memory_target_met"] is None and s["tests_passed"] is None
    assert s["passed"] is True


def test_gpu_check_summary_names_the_rows_off_target():
    """The targets of the report: a measured peak more than 10% off, a predicted-to-fit row out of
    memory, a failed worker or GPU test, or the time budget each make the check fail."""
    from benchmarks.gpu_check import Device, summarize

    def row(ratio=None, **kw):
        return dict(size="motus", optimizer="adamw", batch=4, gradient_checkpointing=False, predicted_peak_gib=100.0,
                    measured_over_predicted=ratio, **kw)

    gpu = Device("cuda")
    base = {"tests": {"returncode": 0}, "seconds": 400.0, "device_memory_gib": 139.8}
    ok = summarize({**base, "rows": [row(1.04), row(0.93)]}, gpu)
    assert ok["memory_target_met"] is True and ok["passed"] is True and ok["time_target_met"] is True
    off = summarize({**base, "rows": [row(1.04), row(1.11)]}, gpu)
    assert off["passed"] is False and off["memory_rows_off_target"] == [
        "motus adamw batch 4 no checkpointing: measured/predicted 1.11"]
    oom = summarize({**base, "rows": [row(error="out of memory", predicted_fits=True)]}, gpu)
    assert oom["memory_target_met"] is False and "out of memory" in oom["memory_rows_off_target"][0]
    expected_oom = summarize({**base, "rows": [row(1.0), row(error="out of memory", predicted_fits=False)]}, gpu)
    assert expected_oom["passed"] is True
    assert summarize({**base, "tests": {"returncode": 1}, "rows": [row(1.0)]}, gpu)["passed"] is False
    assert summarize({**base, "seconds": 481.0, "rows": [row(1.0)]}, gpu)["time_target_met"] is False
    worker = summarize({**base, "rows": [dict(size="motus", optimizer="muon_adamw", error="worker exited 1: ...")]}, gpu)
    assert worker["passed"] is False and worker["workers_failed"][0].startswith("motus muon_adamw (worker)")


def test_gpu_check_kills_a_hung_command_with_its_children():
    """A GPU test that hangs is killed with the torchrun children it started (its process group),
    so none of them keeps the GPU busy under the workers that follow."""
    from benchmarks.gpu_check import run_bounded

    code, out, _ = run_bounded(["bash", "-c", "sleep 600 & echo $!; wait"], timeout=2)
    assert code is None
    child = int(out.split()[0])

    def running(pid):  # a killed orphan may stay a zombie (state Z) until something reaps it
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    for _ in range(100):  # the kill is delivered asynchronously: give it a moment
        if not running(child):
            break
        time.sleep(0.05)
    assert not running(child)


def test_frozen_parts_move_to_the_device_only_when_a_batch_needs_them(tmp_path):
    """CPU stand-in for the GPU: the `meta` device (a move there is visible, nothing is computed).
    A batch from a latent cache moves no frozen part; a batch that needs text embeddings moves umT5."""
    from models import build_world_model
    from tests.helpers import config_from
    from utils.batch import DataBatch

    cfg = config_from(tmp_path, {"common": {"action_dim": 4, "state_dim": 4, "num_video_frames": 4},
                                 "model": {"size": "tiny", "wan": {"vae_path": None, "text_encoder_path": None},
                                           "vlm": {"checkpoint_path": None},
                                           "und_expert": {"vlm": {"input_dim": 32}}}})
    _, encoders = build_world_model(cfg)
    encoders.to("meta")
    cached = DataBatch(video_latents=torch.randn(2, 8, 2, 8, 8), text_embeds=torch.randn(2, 16, 32),
                       text_mask=torch.ones(2, 16, dtype=torch.bool), vlm_features=torch.randn(2, 6, 32),
                       actions=torch.randn(2, 8, 4), instruction=["a", "b"]).to("meta")  # as to_device leaves it
    out = encoders.encode(cached)
    assert encoders.resident() == []
    assert all(p.device.type == "cpu" for m in encoders.modules() for p in m.parameters())
    assert all(getattr(out, k) is getattr(cached, k) for k in ("video_latents", "text_embeds", "vlm_features"))
    with pytest.raises(RuntimeError, match="meta"):  # umT5 reads a value back, which meta cannot give:
        encoders.encode_text(["open the drawer"])  # by then it has been moved, which is what counts here
    assert encoders.resident() == ["text_encoder"]
    assert all(p.device.type == "cpu" for p in encoders.vae.parameters())


def test_gpu_check_runs_every_test_marked_gpu():
    """scripts/gpu_check.sh (benchmarks/gpu_check.py) hands pytest targets that hold every file with a gpu test."""
    from benchmarks.gpu_check import GPU_TESTS

    marked = sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py")
                    and "@pytest.mark.gpu" in open(os.path.join(ROOT, "tests", f)).read())
    assert "test_optim.py" in marked and "test_gpu.py" in marked
    covered = [f for f in marked if any(os.path.join("tests", f).startswith(os.path.normpath(t)) for t in GPU_TESTS)]
    assert covered == marked


def test_the_deterministic_prelude_selects_the_math_attention_backend():
    from models import joint

    flash = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    flash_attn = joint.flash_attn_func
    try:
        exec(DETERMINISTIC_PRELUDE, {})

        assert not torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        assert joint.flash_attn_func is None and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.enable_flash_sdp(flash[0])
        torch.backends.cuda.enable_mem_efficient_sdp(flash[1])
        torch.backends.cuda.enable_cudnn_sdp(True)
        joint.flash_attn_func = flash_attn
