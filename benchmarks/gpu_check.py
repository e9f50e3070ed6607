"""The first GPU run, in one command (`bash scripts/gpu_check.sh`): the GPU tests, then step time,
peak memory, tokens/s and MFU of the `small` and `motus` sizes, beside the memory model's prediction.

    python benchmarks/gpu_check.py [--sizes small motus] [--batches 1 2 4] [--steps 3] [--skip-tests]
    python benchmarks/gpu_check.py --device cpu --sizes tiny --batches 1 2 --steps 1 --optimizers adamw
        [--overrides common.video_height=128 ...]
        (the CPU smoke path of tests/test_gpu.py: every line but the CUDA calls; memory columns null;
        --overrides: config overrides after robotwin.yaml's, recorded in the report)

Each size and optimizer runs in a fresh worker process (one engine; its memory is gone when it
exits): one process, NCCL (gloo on the CPU), DeepSpeed ZeRO-2 (configs/zero2.json), bf16_mixed,
the AdamW kernel of `system.speed.fused_adamw` as training uses it, random init, inputs at the real
shapes of configs/robotwin.yaml (384x320 video, 8 frames, action chunk 16, VLM features of one frame
+ prompt) as a latent cache gives them, so no frozen part is on the GPU. Rows run with
checkpointing first, batches ascending: the predicted peak grows along them, so after an
out-of-memory row the later ones are marked `not run` instead of measured on an engine whose
gradients were half-reduced.

Peak window: `reset_peak_memory_stats` before each row's first step (untimed: it allocates the
optimizer state lazily in the first row, and the autotuned kernels' workspaces), read after its last.
The weights, the optimizer state and ZeRO's gradient partition and buckets are resident in every
row's window, as in the prediction (models/memory_model.py: static + buckets + max(activations, the
optimizer step's transient)).

Writes benchmarks/results/gpu_check.json (rows + a summary of the targets), prints a table, exits 1
when a GPU test or a worker failed, a measured peak is more than 10% off the prediction (or a row
predicted to fit ran out of memory), or the run took longer than the 8-minute budget. Without a
GPU (and without --device cpu) it exits 2 and says so.

Time on one H200, measured (TRAINING.md, "The GPU check"): the GPU tests 217 s, the 4 workers 199 s
(motus MuonAdamW's Newton-Schulz, 406 TFLOP a step on one GPU, takes most of it): 7 minutes of the
8-minute budget.
"""
import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 1024 ** 3
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}  # dense bf16
MEMORY_TOLERANCE = 0.10  # |measured / predicted - 1| of every measured row
TIME_BUDGET_S = 480
TESTS_TIMEOUT_S, WORKER_TIMEOUT_S = 300, 240  # hang guards: a stuck NCCL call cannot eat the whole run


class Device:
    """The CUDA-only calls of the check, in one place: on the CPU (the smoke test) exactly these are
    skipped and the memory figures are None, never a stand-in number."""

    def __init__(self, kind):
        self.type, self.cuda = kind, kind == "cuda"
        self.backend = "nccl" if self.cuda else "gloo"

    def select(self):
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))

    def synchronize(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self):
        return torch.cuda.max_memory_allocated() / GIB if self.cuda else None

    def total_gib(self):
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB if self.cuda else None

    def name(self):
        return torch.cuda.get_device_name() if self.cuda else "cpu"

    def release(self):
        """Return what the freed tensors held (call where no frame still refers to them)."""
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def peak_tflops(device):
    name = device.name()
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None), name


def run_bounded(cmd, timeout, env=None):
    """(returncode or None when it ran past `timeout` s, stdout, stderr). The command runs in its own
    process group, killed as a whole at the timeout: a hung test's torchrun children must not keep
    the GPU (and its memory) busy under the workers that follow."""
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return None, out, err


GPU_TESTS = ["tests"]  # every test marked gpu, wherever it lives (tests/test_gpu.py, tests/test_optim.py, ...)


def run_gpu_tests(out_dir):
    xml = os.path.join(out_dir, "gpu_tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *GPU_TESTS, "-q", f"--junitxml={xml}"]
    start = time.perf_counter()
    code, out, err = run_bounded(cmd, TESTS_TIMEOUT_S)
    summary = f"timed out after {TESTS_TIMEOUT_S} s" if code is None else (out.strip().splitlines() or [""])[-1]
    return {"returncode": code, "summary": summary, "seconds": round(time.perf_counter() - start, 1),
            "output_tail": out[-3000:] + err[-2000:]}


def check_config(size_name, opt, batch, overrides=()):
    """`overrides`: --overrides, after the check's own (the CPU smoke test takes smaller frames)."""
    from recipe.config import load_config

    return load_config(os.path.join(ROOT, "configs", "robotwin.yaml"),
                       [f"model.size={size_name}", f"training.optimizer={opt}", "dataset.cache_dir=/cache",
                        f"training.batch_size={batch}",
                        "training.ema.enabled=false",  # engine_for builds no EMA: keep it out of the prediction
                        *overrides])


def engine_for(cfg, device):
    import deepspeed

    from models.build import size_table_model
    from models.sizes import get_size
    from optim import build_optimizer
    from train.launch_checks import load_deepspeed_config
    from train.speed import set_backend_flags

    set_backend_flags(cfg.system.speed)  # tf32 / cuDNN as training sets them (compile stays off: robotwin.yaml)
    size = get_size(cfg.model.size)
    with torch.device(device.type):
        model = size_table_model(cfg)
    optimizer = build_optimizer(model.named_parameters(), cfg.training, 1, cfg.system.speed.fused_adamw)
    ds = load_deepspeed_config(os.path.join(ROOT, "configs", "zero2.json"), cfg, 1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine, model, size


def measure(engine, model, inputs, checkpointing, steps, device):
    """(median step seconds of `steps` timed steps, peak GiB or None, last loss) of one row."""
    model.gradient_checkpointing = checkpointing
    device.synchronize()
    device.reset_peak()
    times = []
    for i in range(steps + 1):  # step 0: untimed (lazy optimizer state, kernel autotuning), inside the peak window
        start = time.perf_counter()
        out = engine(inputs)
        engine.backward(out.loss)
        engine.step()
        device.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], device.peak_gib(), float(out.loss)


def bench_rows(size_name, opt, batches, steps, device, rows_path=None, overrides=()):
    """Every (checkpointing, batch) row of one size and optimizer, in this process (one engine).
    `rows_path`: rewritten after every row, so a crash keeps the rows measured before it."""
    import deepspeed

    from models import activation_memory
    from models.memory_model import peak, zero2_prediction

    device.select()
    deepspeed.init_distributed(device.backend)
    cfg = check_config(size_name, opt, max(batches), overrides)
    static, per_sample, transient, counts = zero2_prediction(cfg)
    engine, model, size = engine_for(cfg, device)
    tokens = activation_memory.expert_tokens(cfg, model, size)
    flops = activation_memory.model_flops_per_sample(model, tokens)
    tflops, _ = peak_tflops(device)
    total_memory = device.total_gib()
    rows, failed = [], None
    for checkpointing in (True, False):  # ascending predicted peak: see the module docstring
        for batch in sorted(batches):
            predicted = peak(static, per_sample[checkpointing], batch, transient) / GIB
            row = dict(size=size_name, optimizer=opt, batch=batch, gradient_checkpointing=checkpointing,
                       trainable_parameters=counts["video"] + counts["action_expert"] + counts["und_expert"],
                       tokens_per_sample=sum(tokens.values()), expert_tokens=tokens,
                       predicted_peak_gib=round(predicted, 3),
                       predicted_fits=None if total_memory is None else predicted < total_memory)
            if failed:
                row["error"] = f"not run: {failed}"
            else:
                inputs = activation_memory.example_inputs(cfg, model, size, batch, device=device.type).replace(
                    noise_seeds=torch.arange(batch, device=device.type))
                try:
                    step, mem, loss = measure(engine, model, inputs, checkpointing, steps, device)
                except torch.OutOfMemoryError:
                    row["error"] = "out of memory"
                    failed = f"a smaller row ({'' if checkpointing else 'no '}checkpointing, batch {batch}) ran out of memory"
                else:
                    row.update(step_s=round(step, 4), loss=loss, tokens_per_s=round(sum(tokens.values()) * batch / step),
                               mfu=round(flops * batch / step / (tflops * 1e12), 4) if tflops else None,
                               peak_gib=None if mem is None else round(mem, 3),
                               measured_over_predicted=None if mem is None else round(mem / predicted, 3))
                del inputs
                if failed:  # outside the except block: its traceback no longer holds the step's tensors
                    engine.zero_grad()
                    device.release()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if rows_path:
                with open(rows_path, "w") as f:
                    json.dump(rows, f)
    return rows


def run_worker(size_name, opt, args, rows_path):
    """One size and optimizer in a fresh process: its engine's memory is gone when it exits, so the
    next one's peak starts from zero. A world of one: the rendezvous env a launcher would set."""
    from utils.dist import single_process_env

    env = {**os.environ, **single_process_env()}
    if args.device == "cpu":  # on a GPU host too: DeepSpeed would otherwise pick CUDA and move the model there
        env["CUDA_VISIBLE_DEVICES"] = ""
    # motus on one GPU peaks near 121 of an H200's 139 GiB, in tensors of up to 22 GiB (the flat fp32
    # partition and its copies): expandable segments keep the allocator's fragmentation from turning
    # that into an out-of-memory error. max_memory_allocated, what is compared, is the same either way.
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", size_name, opt, "--rows", rows_path,
           "--device", args.device, "--steps", str(args.steps), "--batches", *map(str, args.batches),
           "--overrides", *args.overrides]
    if os.path.exists(rows_path):
        os.remove(rows_path)  # never read a previous run's rows as this one's
    code, _, err = run_bounded(cmd, WORKER_TIMEOUT_S, env)
    error = (f"worker timed out after {WORKER_TIMEOUT_S} s: {err[-1500:]}" if code is None
             else None if code == 0 else f"worker exited {code}: {err[-1500:]}")
    rows = []
    if os.path.exists(rows_path):
        with open(rows_path) as f:
            rows = json.load(f)
    if error or not rows:
        rows.append(dict(size=size_name, optimizer=opt, error=error or "worker wrote no rows"))
    return rows


def row_name(r):
    if "batch" not in r:
        return f"{r['size']} {r['optimizer']} (worker)"
    return f"{r['size']} {r['optimizer']} batch {r['batch']} {'' if r['gradient_checkpointing'] else 'no '}checkpointing"


def summarize(report, device):
    """The targets: every measured peak within MEMORY_TOLERANCE of the prediction, the GPU tests
    passed, every worker finished, the whole run within TIME_BUDGET_S (on a GPU)."""
    rows, tests = report["rows"], report["tests"]
    off, measured = [], 0
    for r in rows:
        if r.get("measured_over_predicted") is not None:
            measured += 1
            if abs(r["measured_over_predicted"] - 1) > MEMORY_TOLERANCE:
                off.append(f"{row_name(r)}: measured/predicted {r['measured_over_predicted']}")
        elif r.get("error") == "out of memory" and r.get("predicted_fits"):
            off.append(f"{row_name(r)}: out of memory, predicted {r['predicted_peak_gib']} GiB "
                       f"of {report['device_memory_gib']:.1f}")
    workers = [f"{row_name(r)}: {r['error'][:300]}" for r in rows if "batch" not in r]
    summary = {
        "tests_passed": None if tests is None else tests["returncode"] == 0,
        "workers_failed": workers,
        "memory_target": f"every measured peak within {MEMORY_TOLERANCE:.0%} of predicted_peak_gib",
        "memory_target_met": (not off) if measured or off else None,  # None: nothing measured (CPU)
        "memory_rows_off_target": off,
        "seconds": report["seconds"], "budget_seconds": TIME_BUDGET_S,
        "time_target_met": report["seconds"] <= TIME_BUDGET_S if device.cuda else None,
    }
    summary["passed"] = (summary["tests_passed"] is not False and not workers and summary["memory_target_met"]
                         is not False and summary["time_target_met"] is not False)
    return summary


def print_table(report):
    print(f"\n{'size':<6} {'opt':<10} {'b':>2} {'ckpt':>5} {'step s':>8} {'peak GiB':>9} {'pred GiB':>9} "
          f"{'meas/pred':>9} {'tok/s':>8} {'MFU':>6}")
    for r in report["rows"]:
        if "batch" not in r:
            print(f"{r['size']:<6} {r['optimizer']:<10} {r['error'][:200]}")
            continue
        print(f"{r['size']:<6} {r['optimizer']:<10} {r['batch']:>2} {str(r['gradient_checkpointing']):>5} "
              f"{r.get('step_s', r.get('error', '-'))!s:>8} {r.get('peak_gib', '-')!s:>9} {r['predicted_peak_gib']:>9} "
              f"{r.get('measured_over_predicted', '-')!s:>9} {r.get('tokens_per_s', '-')!s:>8} {r.get('mfu', '-')!s:>6}")
    s, tests = report["summary"], report["tests"]
    print(f"tests: {tests['summary'] if tests else 'not run'}")
    print(f"memory target ({s['memory_target']}): {s['memory_target_met']}"
          + "".join(f"\n  off: {o}" for o in s["memory_rows_off_target"]))
    for w in s["workers_failed"]:
        print(f"worker failed: {w}")
    print(f"time: {s['seconds']} s of {s['budget_seconds']} s budget; passed: {s['passed']}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["small", "motus"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--optimizers", nargs="+", default=["adamw", "muon_adamw"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (after one untimed)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the smoke path (gloo, no GPU tests, memory columns null)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides after robotwin.yaml's, e.g. smaller frames for the CPU smoke test")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_check.json"))
    p.add_argument("--worker", nargs=2, metavar=("SIZE", "OPTIMIZER"), help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps is {args.steps}; expected at least 1 timed step")
    from utils.config import ConfigError

    try:  # a bad override is one message here, not a failed row per worker
        check_config(*(args.worker or (args.sizes[0], args.optimizers[0])), max(args.batches), args.overrides)
    except ConfigError as e:
        p.error(f"--overrides: {e}")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = Device(args.device)
    if device.cuda and not torch.cuda.is_available():
        print("gpu_check: no GPU: torch.cuda.is_available() is False on this machine; run it where a CUDA "
              "GPU and a CUDA build of torch are present (or pass --device cpu for the smoke path)", file=sys.stderr)
        return 2
    if args.worker:
        bench_rows(*args.worker, args.batches, args.steps, device, args.rows, args.overrides)
        return 0
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    tflops, name = peak_tflops(device)
    if device.cuda and not args.skip_tests:
        print(f"gpu_check: running the GPU tests (pytest -m gpu {' '.join(GPU_TESTS)}) ...", flush=True)
    report = {"device": name, "device_memory_gib": device.total_gib(), "bf16_peak_tflops": tflops,
              "overrides": args.overrides,
              "tests": None if args.skip_tests or not device.cuda else run_gpu_tests(out_dir), "rows": []}
    if report["tests"]:
        print(f"gpu_check: GPU tests: {report['tests']['summary']} ({report['tests']['seconds']} s)", flush=True)
    for size_name in args.sizes:
        for opt in args.optimizers:
            print(f"gpu_check: {size_name} {opt} ...", flush=True)
            report["rows"] += run_worker(size_name, opt, args, os.path.join(out_dir, f"gpu_check_{size_name}_{opt}.json"))
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["summary"] = summarize(report, device)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report)
    print(f"wrote {args.out}")
    return 0 if report["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
