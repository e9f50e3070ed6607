"""The learning curve of one training run in closed loop: inference.rollout on each of the run's
checkpoints, over the same evaluation seeds, side by side in one table.

    python benchmarks/closed_loop_curve.py --run RUN_DIR --task transfer_cube --episodes 20 \
        [--steps-of 2000,4000,9000] [--workers 2] [--replan K] [--out benchmarks/results/closed_loop_curve]

RUN_DIR is a run folder (its checkpoint_step_N folders) as train/train.py writes it. Each checkpoint
gets `python -m inference.rollout --checkpoint ... --baselines ''` into OUT/step_N/ (report.json,
report.md, the first episode's mp4); the hold and expert baselines run once, from the last checkpoint's
rollout, on the same seeds. Prints a table (success with its 95% Wilson interval, how far the episodes
got: the highest reward stage reached, policy latency) and writes OUT/curve.json. An existing OUT/step_N
report is read, not run again, so an interrupted curve continues where it stopped.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.layout import saved_steps  # noqa: E402
from inference.rollout import main as rollout  # noqa: E402

STAGES = (1, 2, 3, 4)  # gym-aloha transfer_cube rewards: 1 right gripper touches the cube, 2 lifts it, 3 left touches it, 4 left holds it up


def checkpoints(run, only):
    """{step: folder} of the run's complete checkpoints (a save still being written is left out)."""
    found = dict(saved_steps(run))
    found = {step: p for step, p in found.items() if not only or step in only}
    if not found:
        raise SystemExit(f"closed_loop_curve: no complete checkpoint_step_N folder"
                         f"{' of ' + str(sorted(only)) if only else ''} in '{run}'")
    return found


def reached(summary):
    """How many episodes reached each reward stage (at least)."""
    best = [e["max_reward"] for e in summary["per_episode"]]
    return {stage: sum(r >= stage for r in best) for stage in STAGES}


def row(name, summary, latency=None):
    lo, hi = summary["wilson_95"]
    stages = reached(summary)
    n = summary["episodes"]
    return {"arm": name, "episodes": n, "successes": summary["successes"], "success_rate": summary["success_rate"],
            "wilson_95": [lo, hi], "reached": stages,
            "latency_ms_p50": None if latency is None else latency["p50"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True)
    p.add_argument("--task", default="transfer_cube")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--steps-of", default="", help="comma-separated checkpoint steps (default: every checkpoint)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--replan", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/closed_loop_curve")
    args = p.parse_args()
    only = {int(s) for s in args.steps_of.split(",") if s}
    found = checkpoints(args.run, only)
    os.makedirs(args.out, exist_ok=True)
    rows, last = [], max(found)
    for step, path in found.items():
        out = os.path.join(args.out, f"step_{step}")
        if not os.path.isfile(os.path.join(out, "report.json")):
            argv = ["--task", args.task, "--checkpoint", path, "--episodes", str(args.episodes), "--out", out,
                    "--videos", "1", "--baselines", "expert,hold" if step == last else ""]
            argv += [] if args.workers is None else ["--workers", str(args.workers)]
            argv += [] if args.replan is None else ["--replan", str(args.replan)]
            rollout(argv)  # a failed rollout exits with its own one-line error
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
        results = report["results"]
        rows.append(dict(row(f"step {step}", results["policy"], results["policy"].get("latency_ms")), step=step))
        if step == last:
            rows += [row(arm, results[arm]) for arm in results if arm != "policy"]
    header = f"{'arm':>12} {'success':>9} {'95% CI':>15} " + " ".join(f"{'>=' + str(s):>5}" for s in STAGES)
    print(f"{args.task}, {args.episodes} evaluation episodes per checkpoint (same seeds), run {args.run}")
    print(header + f" {'p50 ms':>8}")
    for r in rows:
        lo, hi = r["wilson_95"]
        lat = "" if r["latency_ms_p50"] is None else f"{r['latency_ms_p50']:8.0f}"
        print(f"{r['arm']:>12} {r['successes']:>3}/{r['episodes']:<3}  {100 * lo:5.1f}-{100 * hi:5.1f}% "
              + " ".join(f"{r['reached'][s]:>5}" for s in STAGES) + f" {lat}")
    with open(os.path.join(args.out, "curve.json"), "w") as f:
        json.dump({"run": args.run, "task": args.task, "episodes": args.episodes, "rows": rows}, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'curve.json')}")


if __name__ == "__main__":
    main()
