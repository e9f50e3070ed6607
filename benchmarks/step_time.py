"""Step time and loss of the `system.speed` switches: all off, each on alone, all on.

    python benchmarks/step_time.py                       # tiny recipe, 2 CPU processes, ZeRO-2
    python benchmarks/step_time.py --nproc 1 --set model.size=small   # a GPU, the small size

Every variant is a real run of train/train.py (torchrun, --deepspeed configs/zero2.json by
default) over the same --steps steps from the same seed, so the losses are comparable step by
step. The variants run interleaved: --rounds rounds, each running every variant once, in an order
rotated from round to round, so that a machine getting slower or faster during the benchmark
affects every variant alike. Every switch the variant does not turn on is set off explicitly.

Figures (per variant, from its metrics.jsonl):
- step_s: median step time over the steady-state steps (after --skip steps, which hold the
  compilation) of every round; spread_%: (p75 - p25) / median of those, the noise;
- speedup: per round, all-off's median step time / the variant's (> 1: faster); the median
  over rounds (the JSON keeps every round's);
- loss_last20: mean loss over the last 20 steps; loss_diff_%: its difference from all-off;
- wall_s: the whole run, start-up and compilation included (median over rounds).
Switches that cannot apply to the launch are left out and named (cuda_graphs without CUDA;
bucket_cap_mb and static_graph under --deepspeed, where they are refused).
Prints a table and writes JSON to --out.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.results import write_json  # noqa: E402


# what "on" means for each switch; "off" values are in OFF
ON = {"compile": {"compile": True}, "fused_adamw": {"fused_adamw": True}, "tf32": {"tf32": True},
      "cudnn_benchmark": {"cudnn_benchmark": True},
      "cuda_graphs": {"compile": True, "cuda_graphs": True},  # captured inside the compiled layer
      "bucket_cap_mb": {"bucket_cap_mb": 1000}, "static_graph": {"static_graph": True}}
OFF = {"compile": False, "fused_adamw": False, "tf32": False, "matmul_precision": "highest",
       "cudnn_benchmark": False, "cuda_graphs": False, "bucket_cap_mb": None, "static_graph": False}


def applicable(deepspeed, cuda):
    """Switch -> None when it applies to this launch, else why not."""
    why = {}
    if not cuda:
        why["cuda_graphs"] = "needs CUDA"
    if deepspeed:
        why["bucket_cap_mb"] = why["static_graph"] = "DDP only (refused with --deepspeed)"
    return {k: why.get(k) for k in ON}


def variants(switches):
    """Name -> the system.speed values of the variant: off, each switch alone, all."""
    out = {"off": dict(OFF)}
    for name in switches:
        out[name] = {**OFF, **ON[name]}
    out["all"] = {**OFF, **{k: v for name in switches for k, v in ON[name].items()}}
    return out


def overrides(speed):
    return [f"system.speed.{k}={'null' if v is None else v}" for k, v in speed.items()]


def run_variant(args, name, speed, round_index, workdir):
    """One training run; returns (records, wall seconds)."""
    run_name = f"{name}_r{round_index}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), os.path.join(ROOT, "train", "train.py"),
           "--config", args.config, "--checkpoint_dir", workdir, "--run_name", run_name]
    if args.deepspeed:
        cmd += ["--deepspeed", args.deepspeed]
    cmd += [f"training.max_steps={args.steps}", f"training.cycle_length={max(args.steps, 2)}",
            "training.warmup_steps=1", "system.log_interval=1", f"system.save_interval={args.steps}",
            f"system.val_interval={10 * args.steps}", "logging.report_to=none", "logging.progress=lines",
            *args.set, *overrides(speed)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"variant {name} failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                         f"{result.stderr[-6000:]}")
    stem = os.path.splitext(os.path.basename(args.config))[0]
    path = os.path.join(workdir, stem, run_name, "metrics.jsonl")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    shutil.rmtree(os.path.join(workdir, stem, run_name), ignore_errors=True)  # checkpoints: not needed
    return records, wall


def free_port():
    from utils.dist import free_port as port
    return port()


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def steady_times(records, skip):
    return [r["step_time"] for r in records if r["step"] > skip]


def summarise(per_variant, skip, steps):
    """Figures per variant from its rounds' records (one per logging window of equal length).
    The speedup is the median over rounds of each round's all-off median / the variant's median:
    a round's runs are minutes apart, so a machine whose load drifts affects both sides alike."""
    table = {}
    for name, rounds in per_variant.items():
        times = [t for records, _ in rounds for t in steady_times(records, skip)]
        last = [statistics.mean(r["loss"] for r in records if r["step"] > steps - 20) for records, _ in rounds]
        median = statistics.median(times)
        table[name] = {"step_s": median, "spread_%": 100 * (quantile(times, 0.75) - quantile(times, 0.25)) / median,
                       "loss_last20": statistics.mean(last), "wall_s": statistics.median(w for _, w in rounds),
                       "round_step_s": [statistics.median(steady_times(records, skip)) for records, _ in rounds],
                       "losses": [[r["loss"] for r in records] for records, _ in rounds]}
    base = table["off"]
    for row in table.values():
        row["round_speedup"] = [b / v for b, v in zip(base["round_step_s"], row["round_step_s"])]
        row["speedup"] = statistics.median(row["round_speedup"])
        row["loss_diff_%"] = 100 * (row["loss_last20"] - base["loss_last20"]) / base["loss_last20"]
    return table


def print_table(table, skipped):
    print(f"\n{'variant':<16}{'step_s':>10}{'spread_%':>10}{'speedup':>9}{'loss_last20':>13}{'loss_diff_%':>13}"
          f"{'wall_s':>9}")
    for name, r in table.items():
        print(f"{name:<16}{r['step_s']:>10.4f}{r['spread_%']:>10.1f}{r['speedup']:>9.3f}{r['loss_last20']:>13.5f}"
              f"{r['loss_diff_%']:>13.2f}{r['wall_s']:>9.1f}")
    for name, why in skipped.items():
        print(f"{name:<16}left out: {why}")


def measure_parts(args):
    """--parts: where one tiny step's time goes, in this process, each switch's part paired with
    its off twin (alternating call by call, so load drift on a shared machine cancels). The
    compiled twin's encoded inputs feed both models: the same numbers, up to float round-off."""
    import torch

    from models import build_world_model
    from models.build import ALL_FROZEN_PARTS
    from optim import build_optimizer
    from recipe.config import load_config
    from recipe.generated import ensure_generated_inputs
    from utils.batch import DataBatch

    torch.set_num_threads(1)
    cfg = load_config(args.config, args.set)
    ensure_generated_inputs(cfg)
    models, encoders, optimizers = [], [], []
    for on in (False, True):  # the "on" twin: compiled (layer and VAE encoder), fused AdamW
        torch.manual_seed(0)
        model, frozen = build_world_model(cfg, frozen_parts=ALL_FROZEN_PARTS)  # a raw batch
        models.append(model.compile_blocks() if on else model)
        encoders.append(frozen.compile_video_encoder() if on else frozen)
        optimizers.append(build_optimizer(model.named_parameters(), cfg.training, 1, fused_adamw=on))
    gen = torch.Generator().manual_seed(0)
    b, c = cfg.training.batch_size, cfg.common
    batch = DataBatch(
        video=torch.rand(b, c.num_video_frames + 1, 3, c.video_height, c.video_width, generator=gen) * 2 - 1,
        state=torch.randn(b, c.state_dim, generator=gen), instruction=["push the red cube left"] * b,
        actions=torch.randn(b, c.num_video_frames * c.video_action_freq_ratio, c.action_dim, generator=gen))

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def fwd_bwd(i):
        models[i](inputs).loss.backward()

    def opt_step(i):
        optimizers[i].step()
        optimizers[i].zero_grad(set_to_none=True)

    def encode(i):
        nonlocal inputs
        with torch.no_grad():
            inputs = encoders[i].encode(batch).replace(noise_seeds=torch.arange(b))

    inputs = None
    parts = {"encode off (frozen VAE, text, VLM)": [], "encode compile": [], "forward+backward off": [],
             "forward+backward compile": [], "optimizer off": [], "optimizer fused_adamw": []}
    for step in range(args.steps):
        times = [timed(lambda: encode(0)), timed(lambda: encode(1)), timed(lambda: fwd_bwd(0)),
                 timed(lambda: fwd_bwd(1)), timed(lambda: opt_step(0)), timed(lambda: opt_step(1))]
        if step >= args.skip:
            for key, t in zip(parts, times):
                parts[key].append(t)
    table = {k: statistics.median(v) for k, v in parts.items()}
    print(f"\n{'part':<34}{'median_s':>10}")
    for k, v in table.items():
        print(f"{k:<34}{v:>10.4f}")
    ratios = {"compile (encode)": table["encode off (frozen VAE, text, VLM)"] / table["encode compile"],
              "compile (forward+backward)": table["forward+backward off"] / table["forward+backward compile"],
              "fused_adamw (optimizer)": table["optimizer off"] / table["optimizer fused_adamw"]}
    off = sum(table[k] for k in ("encode off (frozen VAE, text, VLM)", "forward+backward off", "optimizer off"))
    on = sum(table[k] for k in ("encode compile", "forward+backward compile", "optimizer fused_adamw"))
    ratios["both, on these parts"] = off / on
    for k, v in ratios.items():
        print(f"speedup {k:<30}{v:>8.3f}")
    return {"parts_s": table, "speedup": ratios}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--deepspeed", default="configs/zero2.json", help="'' for DDP")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--skip", type=int, default=10, help="first steps left out of the step time (compilation)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every variant; the speedup is the median "
                   "over rounds (one round on a shared machine is one noisy sample)")
    p.add_argument("--only", nargs="+", default=None, help="run these variants only (off is always run)")
    p.add_argument("--set", nargs="+", default=[], help="key=value overrides for every variant")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/step_time.json, "
                   "or step_parts.json with --parts)")
    p.add_argument("--parts", action="store_true",
                   help="one process, no launcher: time the step's parts with each switch paired with its off twin")
    args = p.parse_args(argv)
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", "step_parts.json" if args.parts else "step_time.json")
    if args.parts:
        result = measure_parts(args)
        write_json(args.out, {"config": args.config, "steps": args.steps, "skip": args.skip, "set": args.set, **result})
        return
    if args.steps < args.skip + 20:
        p.error(f"--steps {args.steps} must be at least --skip + 20 ({args.skip + 20}): the loss is the mean of the last 20")
    import torch

    why = applicable(bool(args.deepspeed), torch.cuda.is_available())
    switches = [k for k, w in why.items() if w is None]
    skipped = {k: w for k, w in why.items() if w is not None}
    plan = variants(switches)
    if args.only:
        plan = {k: v for k, v in plan.items() if k in args.only or k == "off"}
    names = list(plan)
    per_variant = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="step_time_") as workdir:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # rotated each round
            for name in order:
                per_variant[name].append(run_variant(args, name, plan[name], r, workdir))
                times = steady_times(per_variant[name][-1][0], args.skip)
                print(f"round {r} {name}: median step {statistics.median(times):.4f} s, "
                      f"wall {per_variant[name][-1][1]:.0f} s", flush=True)
    table = summarise(per_variant, args.skip, args.steps)
    print_table(table, skipped)
    write_json(args.out, {"config": args.config, "deepspeed": args.deepspeed, "nproc": args.nproc,
                          "steps": args.steps, "skip": args.skip, "rounds": args.rounds, "set": args.set,
                          "cuda": torch.cuda.is_available(),
                          "variants": {name: {"speed": plan[name], **row} for name, row in table.items()},
                          "left_out": skipped})


if __name__ == "__main__":
    main()
