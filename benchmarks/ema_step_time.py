"""Step-time cost of the EMA (training.ema) on the tiny recipe: EMA off and on, side by side.

    python benchmarks/ema_step_time.py [--procs 2] [--deepspeed configs/zero2.json] [--rounds 30] [--steps 2]

One set of --procs processes (gloo on CPU, NCCL on GPUs) builds the tiny recipe as train/train.py
does (data, model, MuonAdamW, the DeepSpeed engine, the EMA over its ZeRO partitions) and then
times training steps in rounds; each round runs --steps steps without the EMA update and
--steps steps with it (the order alternating between rounds), so that both variants see the same
machine load. A step is forward + backward + optimizer step (+ `ema.update`), the slowest rank's
time. Reported, per variant: the median over rounds of the mean step time; ratio = on / off of
those medians;
`paired_ratio`: the median over rounds of on / off within a round (the two ran seconds apart, so
this cancels most of the drift of a shared machine); `ema_update_s`: the median time of the EMA
update alone; `ema_share` = ema_update_s / step time
(the cost without the noise of two whole steps); `ema_mib_per_rank`: the EMA's memory on rank 0.
Writes a table to stdout and JSON to --out.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from utils.dist import free_port  # noqa: E402

EMA_ON = ["training.ema.enabled=true", "training.ema.start_step=0", "training.ema.update_every=1"]


def _step(engine, encoders, stream, cfg, step):
    from train.step_inputs import noise_seeds, to_device
    batch = to_device(next(stream), engine.device)
    inputs = encoders.encode(batch).replace(noise_seeds=noise_seeds(cfg.training.seed, step, batch))
    engine.micro_step(inputs, is_last=True)
    engine.optimizer_step(step)


def _sync(engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()


def _slowest(seconds, device):
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def worker(args):
    from data import build_train_stream
    from recipe.config import load_config
    from train.launch_checks import load_deepspeed_config
    from train.launch import make_accelerator, make_engine
    from train.train import build_everything, make_generated_inputs
    from utils import dist

    overrides = ["system.num_workers=0", "logging.report_to=none", *EMA_ON, *args.overrides]
    cfg = load_config(args.config, overrides)
    ds = load_deepspeed_config(args.deepspeed, cfg, dist.world_size()) if args.deepspeed else None
    accelerator = make_accelerator(ds, cfg.system.dist_timeout_minutes)
    dist.fail_together(make_generated_inputs, cfg)
    (train_set, _, _), model, encoders, optimizer = dist.fail_together(build_everything, cfg, dist.world_size())
    engine = make_engine(accelerator, model, optimizer, cfg)
    encoders.to(engine.device)
    stream = build_train_stream(train_set, cfg, dist.rank(), dist.world_size())
    engine.train()
    ema, engine.ema = engine.ema, None  # updated by hand below, so that "off" skips it and "on" times it alone
    step, times, updates = 0, {"off": [], "on": []}, []
    for r in range(args.warmup + args.rounds):
        for variant in (("off", "on") if r % 2 == 0 else ("on", "off")):
            _sync(engine)
            start = time.perf_counter()
            for _ in range(args.steps):
                step += 1
                _step(engine, encoders, stream, cfg, step)
                if variant == "on":
                    t0 = time.perf_counter()
                    ema.update(step)
                    if engine.device.type == "cuda":
                        torch.cuda.synchronize()
                    updates.append(time.perf_counter() - t0)
            _sync(engine)
            if r >= args.warmup:
                times[variant].append(_slowest((time.perf_counter() - start) / args.steps, engine.device))
    if dist.is_main():
        with open(args.raw, "w") as f:
            json.dump({"times": times, "updates": updates[args.warmup * args.steps:],
                       "ema_bytes": ema.nbytes, "world_size": dist.world_size(),
                       "device": str(engine.device)}, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--deepspeed", default="configs/zero2.json", help="'' for DDP")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (each runs both variants)")
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--out", default="benchmarks/results/ema_step_time.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_intermixed_args()
    if args.worker:
        return worker(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    raw_path = args.out + ".tmp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.procs), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.abspath(__file__), "--worker", "--raw", raw_path,
           "--config", args.config, "--deepspeed", args.deepspeed, "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--warmup", str(args.warmup), *args.overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    with open(raw_path) as f:
        raw = json.load(f)
    os.remove(raw_path)
    off, on = (statistics.median(raw["times"][v]) for v in ("off", "on"))
    update = statistics.median(raw["updates"])
    paired = statistics.median(b / a for a, b in zip(raw["times"]["off"], raw["times"]["on"]))
    row = dict(procs=raw["world_size"], deepspeed=args.deepspeed or "ddp", device=raw["device"],
               step_s_off=off, step_s_on=on, ratio=on / off, paired_ratio=paired, ema_update_s=update,
               ema_share=update / off,
               ema_mib_per_rank=raw["ema_bytes"] / 2 ** 20, rounds=args.rounds, steps_per_round=args.steps)
    print(f"{'procs':>5} {'engine':<20} {'off s/step':>10} {'on s/step':>10} {'ratio':>6} {'paired':>6} "
          f"{'update ms':>9} {'share':>7} {'EMA MiB/rank':>12}")
    print(f"{row['procs']:>5} {row['deepspeed']:<20} {off:>10.4f} {on:>10.4f} {row['ratio']:>6.3f} {paired:>6.3f} "
          f"{update * 1e3:>9.3f} {row['ema_share']:>7.2%} {row['ema_mib_per_rank']:>12.2f}")
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), rows=[row], raw=raw), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
