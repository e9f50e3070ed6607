"""The `system.speed` switches: regional compilation gives the eager numbers and one graph for
every layer, impossible combinations are refused at load or launch, the backend flags and DDP's
options reach torch."""
import functools
import os
import re

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from train import speed  # noqa: E402
from recipe.config import load_config  # noqa: E402
from train.launch_checks import check_launch  # noqa: E402
from utils.batch import DataBatch  # noqa: E402
from utils.config import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_inputs(encoders, batch_size=2):
    gen = torch.Generator().manual_seed(0)
    batch = DataBatch(video=torch.rand(batch_size, 5, 3, 64, 64, generator=gen) * 2 - 1,
                      state=torch.randn(batch_size, 8, generator=gen), actions=torch.randn(batch_size, 8, 4, generator=gen),
                      instruction=["push the red cube left", "open the drawer"][:batch_size])
    return encoders.encode(batch).replace(noise_seeds=torch.tensor([11, 12][:batch_size]))


# The compile tests run on the CPU through `aot_eager`: dynamo's capture and AOTAutograd's joint
# forward/backward (with the checkpoint's recompute), which is what our code shapes (graph breaks,
# recompiles, saved activations), with eager kernels. Inductor's CPU C++ build of these graphs costs
# 2.5 min of a cold 2-core CI machine and tests torch's code generator, not ours; on a GPU they run
# inductor, as training does (`pytest -m gpu`).
@pytest.fixture(params=[("cpu", "aot_eager"), pytest.param(("cuda", "inductor"), marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])],
    ids=["cpu-aot_eager", "cuda-inductor"])
def compile_device(request, monkeypatch):
    """The device a compile test runs on, with torch.compile set to that device's backend."""
    device, backend = request.param
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    return device


def test_compiled_layer_matches_eager_and_is_one_graph_for_every_layer(compile_device):
    """The tiny model, fp32, with gradient checkpointing: the losses (forward) and every gradient
    (backward, with the recompute) of the compiled layer against eager, within float round-off;
    both layers run one compiled graph."""
    from torch._dynamo.utils import counters

    from models import build_world_model

    cfg = load_config("configs/tiny.yaml", ["model.gradient_checkpointing=true"])
    torch.manual_seed(0)
    model, encoders = build_world_model(cfg)
    with torch.no_grad():  # a trained-like decoder, so the action path shows in the outputs
        model.action_expert.proj_out.weight.normal_(0, 0.1)
    inputs = tiny_inputs(encoders)
    model, inputs = model.to(compile_device), inputs.to(compile_device)

    def losses_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(inputs)
        out.loss.backward()
        return (out.logged(),
                {n: p.grad.clone() for n, p in model.named_parameters()})

    eager_losses, eager_grads = losses_and_grads()
    torch._dynamo.reset()
    counters.clear()
    model.compile_blocks()
    compiled_losses, compiled_grads = losses_and_grads()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs == 1, f"{graphs} graphs for {len(model.video.blocks)} layers: the layers do not share one"
    for k, want in eager_losses.items():
        assert torch.allclose(compiled_losses[k], want, rtol=1e-5, atol=1e-6), (k, compiled_losses[k], want)
    block_grad = eager_grads["video.blocks.1.attn1.to_q.weight"]
    assert block_grad.abs().max() > 0  # the compiled layer's weights really get gradients
    for name, want in eager_grads.items():
        scale = want.abs().max().clamp_min(1e-12)
        assert (compiled_grads[name] - want).abs().max() / scale < 1e-4, name


def test_compiled_vae_encoder_gives_the_eager_latents(compile_device, monkeypatch):
    """`compile` also compiles the frozen VAE's encoder (most of the tiny step's encode time): the
    latents of a batch equal the eager ones within float round-off, the decoder stays eager, and
    the encoder keeps its parameter names (nothing saved or loaded changes). One frame: the Wan VAE
    encodes a clip as a first frame, then chunks of 4 frames with a cache, each its own graph; the
    second graph would cost another build and run no line of ours."""
    from models import build_world_model

    # cuDNN's TF32 off on both sides: its default TF32 convolutions (10-bit mantissa) differ from
    # inductor's kernels by ~1e-3 on an H200, which is TF32's rounding, not float round-off (matmuls
    # are fp32 by default already)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    cfg = load_config("configs/tiny.yaml")
    _, encoders = build_world_model(cfg)
    encoders.to(compile_device)
    video = (torch.rand(2, 1, 3, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1).to(compile_device)
    names = [n for n, _ in encoders.vae.named_parameters()]
    eager = encoders.encode_video(video)
    torch._dynamo.reset()
    encoders.compile_video_encoder()
    compiled = encoders.encode_video(video)
    torch._dynamo.reset()
    assert [n for n, _ in encoders.vae.named_parameters()] == names
    assert encoders.vae.encoder._compiled_call_impl is not None and encoders.vae.decoder._compiled_call_impl is None
    err = float((compiled - eager).abs().max() / eager.abs().max())
    assert err < 1e-5, err


@pytest.mark.parametrize("overrides, message", [
    (["system.speed.compile=false", "system.speed.cuda_graphs=true"],
     "'system.speed.cuda_graphs' is true but 'system.speed.compile' is false"),
    (["system.speed.compile=true", "system.speed.cuda_graphs=true", "model.gradient_checkpointing=true"],
     "'system.speed.cuda_graphs' and 'model.gradient_checkpointing' are both true"),
    (["system.speed.tf32=false", "system.speed.matmul_precision=high"],
     "'system.speed.matmul_precision' is high (TF32 or bf16 matmuls) but 'system.speed.tf32' is false"),
    (["system.speed.static_graph=true", "training.gradient_accumulation_steps=2"],
     "'system.speed.static_graph' is true and 'training.gradient_accumulation_steps' is 2"),
    (["system.speed.matmul_precision=fast"], "'system.speed.matmul_precision'"),
    (["system.speed.bucket_cap_mb=0"], "'system.speed.bucket_cap_mb' is 0; expected null (torch's default)"),
])
def test_impossible_switch_combinations_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.yaml", overrides)


@pytest.mark.parametrize("override", ["system.speed.static_graph=true", "system.speed.bucket_cap_mb=512"])
def test_ddp_switches_are_refused_under_deepspeed(override):
    cfg = load_config("configs/tiny.yaml", [override])
    assert check_launch(cfg, 2, None) is None  # DDP: fine
    with pytest.raises(ConfigError, match="applies to DDP only, and this run uses --deepspeed"):
        check_launch(cfg, 2, "configs/zero2.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_graphs_refused_without_cuda():
    cfg = load_config("configs/tiny.yaml", ["system.speed.compile=true", "system.speed.cuda_graphs=true"])
    with pytest.raises(ConfigError, match="cuda_graphs=true needs CUDA"):
        check_launch(cfg, 1, "configs/zero2.json")


def test_backend_flags_follow_the_switches():
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    try:
        on = speed.set_backend_flags(load_config("configs/tiny.yaml", [
            "system.speed.tf32=true", "system.speed.matmul_precision=null", "system.speed.cudnn_benchmark=true"]).system.speed)
        assert on == {"matmul_precision": "high", "cuda.matmul.allow_tf32": True, "cudnn.allow_tf32": True,
                      "cudnn.benchmark": True}
        off = speed.set_backend_flags(load_config("configs/tiny.yaml", [
            "system.speed.tf32=false", "system.speed.cudnn_benchmark=false"]).system.speed)
        assert off == {"matmul_precision": "highest", "cuda.matmul.allow_tf32": False, "cudnn.allow_tf32": False,
                       "cudnn.benchmark": False}
        medium = speed.set_backend_flags(load_config("configs/tiny.yaml", [
            "system.speed.tf32=true", "system.speed.matmul_precision=medium"]).system.speed)
        assert medium["matmul_precision"] == "medium"
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = before[1], before[2]


def test_ddp_kwargs_reach_accelerate():
    cfg = load_config("configs/tiny.yaml", ["system.speed.bucket_cap_mb=1000", "system.speed.static_graph=true"])
    assert speed.ddp_kwargs(cfg.system.speed).to_kwargs() == {"bucket_cap_mb": 1000, "static_graph": True}
    default = speed.ddp_kwargs(load_config("configs/tiny.yaml", ["system.speed.static_graph=false"]).system.speed)
    assert default.to_kwargs() == {}  # torch's own defaults (25 MB buckets, no static graph)


def test_step_time_benchmark_plans_each_switch_alone_and_takes_the_median_of_round_ratios():
    """benchmarks/step_time.py: every variant sets every switch (off unless it is the variant's), and a
    variant's speedup is the median over rounds of all-off's median step time over its own."""
    from benchmarks import step_time

    plan = step_time.variants(["compile", "fused_adamw"])
    assert list(plan) == ["off", "compile", "fused_adamw", "all"]
    assert all(set(v) == set(step_time.OFF) for v in plan.values())
    assert plan["compile"] == {**step_time.OFF, "compile": True}
    assert plan["all"] == {**step_time.OFF, "compile": True, "fused_adamw": True}

    def run(times, loss=2.0):  # records of one run: step 1 (compilation) is skipped
        return [{"step": i + 1, "step_time": t, "loss": loss} for i, t in enumerate(times)], 10.0

    rounds = {"off": [run([9.0, 1.0, 1.0, 1.0]), run([9.0, 2.0, 2.0, 2.0]), run([9.0, 1.0, 1.0, 1.0])],
              "all": [run([9.0, 0.5, 0.5, 0.5]), run([9.0, 2.0, 2.0, 2.0]), run([9.0, 0.25, 0.25, 0.25], loss=2.2)]}
    table = step_time.summarise(rounds, skip=1, steps=4)
    assert table["all"]["round_speedup"] == [2.0, 1.0, 4.0] and table["all"]["speedup"] == 2.0
    assert table["off"]["speedup"] == 1.0
    assert table["all"]["loss_diff_%"] == pytest.approx(100 * (2.0667 - 2.0) / 2.0, abs=0.01)
