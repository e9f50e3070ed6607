"""The first GPU run, in one command (`bash scripts/gpu_check.sh`): the GPU tests, then step time,
peak memory, tokens/s and MFU of the `small` and `motus` sizes, beside the memory model's prediction.

    python benchmarks/gpu_check.py [--sizes small motus] [--batches 1 2 4] [--steps 3]

One process, NCCL, DeepSpeed ZeRO-2 (configs/zero2.json), bf16_mixed, random init, inputs at the
real shapes (configs/robotwin.yaml: 384x320 video, 8 frames = 360 video tokens, action chunk 16,
VLM features of one frame + prompt) as a latent cache gives them, so no frozen part is on the GPU.
Writes benchmarks/results/gpu_check.json and prints a table. Without a GPU it exits 2 and says so.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 1024 ** 3
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense bf16


def run_gpu_tests(out_dir):
    xml = os.path.join(out_dir, "gpu_tests.xml")
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", f"--junitxml={xml}"],
                       cwd=ROOT, capture_output=True, text=True)
    return {"returncode": r.returncode, "summary": (r.stdout.strip().splitlines() or [""])[-1],
            "output_tail": r.stdout[-3000:] + r.stderr[-2000:]}


def peak_tflops():
    name = torch.cuda.get_device_name()
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None), name


def engine_for(cfg):
    import deepspeed

    from models.build import size_table_model
    from models.sizes import get_size
    from optim import build_optimizer
    from train.engine import load_deepspeed_config

    size = get_size(cfg.model.size)
    with torch.device("cuda"):
        model = size_table_model(cfg)
    optimizer = build_optimizer(model.named_parameters(), cfg.training, 1)
    ds = load_deepspeed_config(os.path.join(ROOT, "configs", "zero2.json"), cfg, 1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine, model, size


def tokens_per_sample(cfg, model, size):
    """Tokens of the joint attention per sample: video (Wan patches of the latents), action
    ([state |] chunk | registers) and understanding (VLM features)."""
    from models import activations

    inputs = activations.example_inputs(cfg, model, size, 1, device="meta")
    _, frames, h, w = inputs["video_latents"].shape[1:]
    p_t, p_h, p_w = model.video.config.patch_size
    action = cfg.common.action_chunk_size + cfg.model.action_expert.num_registers + ("state" in inputs)
    return frames // p_t * (h // p_h) * (w // p_w) + action + inputs["vlm_features"].shape[1]


def measure(engine, model, cfg, size, batch, checkpointing, steps):
    from models import activations

    model.gradient_checkpointing = checkpointing
    inputs = activations.example_inputs(cfg, model, size, batch, device="cuda")
    inputs["noise_seeds"] = torch.arange(batch, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):  # the first step allocates the optimizer state: not timed
        start = time.perf_counter()
        out = engine(inputs)
        engine.backward(out["loss"])
        engine.step()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / GIB, float(out["loss"])


def bench_rows(size_name, opt, batches, steps):
    """Every (checkpointing, batch) row of one size and optimizer, in this process (one engine)."""
    import deepspeed

    from models.summary import budget, count_components, peak, step_transient
    from train.config import load_config

    tflops, _ = peak_tflops()
    torch.cuda.set_device(0)
    deepspeed.init_distributed("nccl")
    cfg = load_config(os.path.join(ROOT, "configs", "robotwin.yaml"),
                      [f"model.size={size_name}", f"training.optimizer={opt}", "dataset.cache_dir=/cache",
                       f"training.batch_size={max(batches)}",
                       "training.ema.enabled=false"])  # engine_for builds no EMA: keep it out of the prediction
    counts, fake, size = count_components(cfg)
    memory = torch.cuda.get_device_properties(0).total_memory / GIB
    predicted = budget(cfg, counts, fake, size, gpus=1, gpu_memory=memory)
    trainable = counts["video"] + counts["action_expert"] + counts["und_expert"]
    static = predicted["zero2"]["static_total"] * GIB
    transient = step_transient(trainable, cfg.model.precision, 1, 2)
    engine, model, size = engine_for(cfg)
    tokens = tokens_per_sample(cfg, model, size)
    rows = []
    for checkpointing in (False, True):
        acts = predicted["activations_gib_per_sample"]["checkpointing" if checkpointing else "no_checkpointing"]
        per_sample = (acts["kept"] + acts["working_set"]) * GIB
        for batch in batches:
            row = dict(size=size_name, optimizer=opt, batch=batch, gradient_checkpointing=checkpointing,
                       tokens_per_sample=tokens)
            try:
                step, mem, loss = measure(engine, model, cfg, size, batch, checkpointing, steps)
            except torch.OutOfMemoryError:
                row.update(error="out of memory")
                torch.cuda.empty_cache()
            else:
                flops = 6 * trainable * tokens * batch  # forward + backward of the matmuls (6 N T; no recompute)
                row.update(step_s=round(step, 4), peak_gib=round(mem, 2), loss=round(loss, 4),
                           tokens_per_s=round(tokens * batch / step),
                           mfu=round(flops / step / (tflops * 1e12), 4) if tflops else None)
            row["predicted_peak_gib"] = round(peak(static, per_sample, batch, transient) / GIB, 2)
            if "peak_gib" in row:
                row["measured_over_predicted"] = round(row["peak_gib"] / row["predicted_peak_gib"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def run_worker(size_name, opt, args, rows_path):
    """One size and optimizer in a fresh process: its engine's memory is gone when it exits, so the
    next one's peak starts from zero."""
    from utils.dist import free_port

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", size_name, opt, "--rows", rows_path,
           "--steps", str(args.steps), "--batches", *map(str, args.batches)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(rows_path):
        return [dict(size=size_name, optimizer=opt, error=f"worker exited {r.returncode}: {r.stderr[-1500:]}")]
    with open(rows_path) as f:
        return json.load(f)


def print_table(report):
    print(f"\n{'size':<6} {'opt':<10} {'b':>2} {'ckpt':>5} {'step s':>8} {'peak GiB':>9} {'pred GiB':>9} "
          f"{'meas/pred':>9} {'tok/s':>8} {'MFU':>6}")
    for r in report["rows"]:
        if "batch" not in r:
            print(f"{r['size']:<6} {r['optimizer']:<10} {r['error'][:200]}")
            continue
        print(f"{r['size']:<6} {r['optimizer']:<10} {r['batch']:>2} {str(r['gradient_checkpointing']):>5} "
              f"{r.get('step_s', 'OOM')!s:>8} {r.get('peak_gib', '-')!s:>9} {r['predicted_peak_gib']:>9} "
              f"{r.get('measured_over_predicted', '-')!s:>9} {r.get('tokens_per_s', '-')!s:>8} {r.get('mfu', '-')!s:>6}")
    tests = report["tests"]
    print(f"tests: {tests['summary'] if tests else 'skipped'}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["small", "motus"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--optimizers", nargs="+", default=["adamw", "muon_adamw"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_check.json"))
    p.add_argument("--worker", nargs=2, metavar=("SIZE", "OPTIMIZER"), help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no GPU: torch.cuda.is_available() is False on this machine; run it where a CUDA "
              "GPU and a CUDA build of torch are present", file=sys.stderr)
        return 2
    if args.worker:
        rows = bench_rows(*args.worker, args.batches, args.steps)
        with open(args.rows, "w") as f:
            json.dump(rows, f)
        return 0
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    report = {"device": peak_tflops()[1], "bf16_peak_tflops": peak_tflops()[0],
              "tests": None if args.skip_tests else run_gpu_tests(out_dir), "rows": []}
    for size_name in args.sizes:
        for opt in args.optimizers:
            report["rows"] += run_worker(size_name, opt, args, os.path.join(out_dir, f"gpu_check_{size_name}_{opt}.json"))
    report["seconds"] = round(time.perf_counter() - start, 1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report)
    print(f"{report['seconds']} s; wrote {args.out}")
    failed = (report["tests"] and report["tests"]["returncode"] != 0) or any("error" in r and "batch" not in r
                                                                             for r in report["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
