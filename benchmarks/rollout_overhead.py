"""How much of a closed-loop rollout is the simulator: inference.rollout against a constant policy (the
cheapest a policy can be, served by inference.serve's BatchingServer), per task: executing the whole
chunk (the default) with the server's default batching window (serving.batch_window_ms 5) and with none,
and replanning every step.

    python benchmarks/rollout_overhead.py [--tasks transfer_cube,pusht] [--episodes 4] [--steps 100] \
        [--workers 2] [--chunk 8] [--out benchmarks/results/rollout_overhead.json]

The split is of episode time summed over the workers (simulator: reset, physics and rendering;
policy: the websocket round trip; rest: the rollout's own work), as report.json states it; the
command's wall time also holds starting the worker processes. Target (issue 21): with a constant
policy, >= 90% of episode time is the simulator.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.sim_env import get_task  # noqa: E402
from recipe.schema import ServingConfig  # noqa: E402
from inference.constant_policy import ConstantPolicy, serve_in_thread  # noqa: E402
from inference.rollout import main as rollout  # noqa: E402
from utils.dist import free_port  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


DEFAULT_WINDOW_MS = ServingConfig().batch_window_ms  # what inference.serve batches with unless told
IMAGE_SIZE = {"transfer_cube": (64, 64), "insertion": (64, 64), "pusht": (96, 96)}


def hold_action(task):
    if task.module == "gym_aloha":
        from gym_aloha.constants import START_ARM_POSE

        return np.concatenate([START_ARM_POSE[:6], [0.5], START_ARM_POSE[8:14], [0.5]])
    return np.full(task.action_dim, 256.0)  # pusht: the middle of its 512x512 workspace


def run(task, replan, window_ms, args):
    policy = ConstantPolicy.for_task(task, hold_action(task), args.chunk, IMAGE_SIZE[task.name])
    port = free_port()
    stop = serve_in_thread(policy, port, batch_window_ms=window_ms)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            report = rollout(["--task", task.name, "--policy", f"ws://127.0.0.1:{port}", "--episodes",
                              str(args.episodes), "--steps", str(args.steps), "--workers", str(args.workers),
                              "--replan", str(replan), "--videos", "0", "--baselines", "", "--out",
                              os.path.join(tmp, "report")])
    finally:
        stop()
    split, pol = report["time_split"], report["results"]["policy"]
    steps = sum(e["steps"] for e in pol["per_episode"])
    return {"task": task.name, "replan": replan, "batch_window_ms": window_ms, "episodes": args.episodes,
            "steps": steps,
            "workers": report["workers"], "wall_s": report["wall_s"], **split,
            "latency_p50_ms": pol["latency_ms"]["p50"], "latency_p99_ms": pol["latency_ms"]["p99"],
            "episode_ms_per_step": 1000 * (split["simulator_s"] + split["policy_s"] + split["rest_s"]) / steps}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="transfer_cube,pusht")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=8, help="the constant policy's chunk (the tiny recipe's is 8)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "rollout_overhead.json"))
    args = p.parse_args()
    rows = []
    for name in args.tasks.split(","):
        task = get_task(name)
        for replan, window_ms in ((args.chunk, DEFAULT_WINDOW_MS), (args.chunk, 0.0), (1, DEFAULT_WINDOW_MS)):
            rows.append(run(task, replan, window_ms, args))
    print(f"\n{'task':14} {'replan':>6} {'window':>6} {'steps':>6} {'wall s':>7} {'sim %':>6} {'policy %':>8} "
          f"{'rest %':>6} "
          f"{'p50 ms':>7} {'p99 ms':>7} {'ms/step':>8} {'vs chunk':>8}")
    for row in rows:
        base = rows[3 * (rows.index(row) // 3)]  # the task's default: whole chunk, default window
        row["time_per_step_vs_whole_chunk"] = row["episode_ms_per_step"] / base["episode_ms_per_step"]
        print(f"{row['task']:14} {row['replan']:6d} {row['batch_window_ms']:6.0f} {row['steps']:6d} "
              f"{row['wall_s']:7.1f} "
              f"{100 * row['simulator_fraction']:6.1f} {100 * row['policy_fraction']:8.1f} "
              f"{100 * row['rest_fraction']:6.1f} {row['latency_p50_ms']:7.1f} {row['latency_p99_ms']:7.1f} "
              f"{row['episode_ms_per_step']:8.2f} {row['time_per_step_vs_whole_chunk']:7.2f}x")
    write_json(args.out, {"cpu_count": os.cpu_count(), "args": vars(args), "results": rows})


if __name__ == "__main__":
    main()
