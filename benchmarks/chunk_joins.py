"""What a policy's joins between chunks do in closed loop, read from a rollout's recorded episodes.

    python -m inference.rollout --task transfer_cube --checkpoint RUN --which best --episodes 150 \
        --seed 1000050 --record 150 --videos 0 --baselines '' --out ROLLOUT
    python benchmarks/chunk_joins.py ROLLOUT [ROLLOUT ...] [--out benchmarks/results/chunk_joins.json]

`--record` writes each policy episode's executed actions, the states observed before them and the
steps that opened a chunk (inference/rollout_episode.py). Per rollout, on the twelve arm joints
(radians; the grippers left out):
- `join step`: the largest joint change from the old chunk's last action to the new chunk's first,
  over every join; `chunk step`: the same between two actions of one chunk (what a smooth chunk moves
  in a step), as mean and 95th percentile;
- `lead at a join`: the distance (over the twelve joints, as `benchmarks/chunk_start.py`'s lead) of the
  new chunk's first action from the observed state: how far ahead of the arm a chunk starts;
- the episodes that lift the cube and never finish (reward 2 at best, transfer_cube's rule): the step
  each last holds it lifted, and how many of those steps lie within 3 steps after a join.
Printed as a table and written to OUT.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.results import write_json  # noqa: E402

ARMS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]  # the two arms' six joints; 6 and 13 are the grippers
NEAR_JOIN = 3  # steps after a join within which a drop counts as at the join
LIFTED = 2  # transfer_cube's reward while the cube is off the table in one gripper


def episode_figures(actions: np.ndarray, states: np.ndarray, queries: np.ndarray) -> dict[str, list[float]]:
    """One recorded episode -> its join steps and within-chunk steps (the largest arm joint's change) and
    its leads at joins."""
    arm = actions[:, ARMS]
    steps = np.abs(np.diff(arm, axis=0)).max(axis=1)  # steps[t - 1]: from action t - 1 to action t
    joins = [int(t) for t in queries if t > 0]
    at_join = np.zeros(len(steps), bool)
    at_join[[t - 1 for t in joins]] = True
    return {"join": steps[at_join].tolist(), "chunk": steps[~at_join].tolist(),
            "lead": [float(np.linalg.norm(arm[t] - states[t, ARMS])) for t in joins]}


def summarise(folder: str) -> dict[str, object]:
    report = json.load(open(os.path.join(folder, "report.json")))
    rows = [r for r in report["results"]["policy"]["per_episode"] if "record" in r]
    if not rows:
        raise SystemExit(f"{folder}: no recorded episode; roll out with --record N")
    join, chunk, lead, drops, near = [], [], [], [], 0
    for row in rows:
        rec = np.load(os.path.join(folder, row["record"]))
        figures = episode_figures(rec["actions"], rec["states"], rec["queries"])
        join += figures["join"]
        chunk += figures["chunk"]
        lead += figures["lead"]
        rewards = rec["rewards"]
        if not row["success"] and rewards.max() == LIFTED:
            last = int(np.flatnonzero(rewards >= LIFTED)[-1])
            drops.append(last)
            near += any(0 <= last - t < NEAR_JOIN for t in rec["queries"] if t > 0)
    return {"rollout": folder, "episodes": len(rows), "successes": sum(r["success"] for r in rows),
            "join_step_mean": float(np.mean(join)), "join_step_p95": float(np.percentile(join, 95)),
            "chunk_step_mean": float(np.mean(chunk)), "chunk_step_p95": float(np.percentile(chunk, 95)),
            "lead_mean": float(np.mean(lead)), "lifted_not_finished": len(drops),
            "last_lifted_steps": sorted(drops), "dropped_at_a_join": near}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rollouts", nargs="+", help="inference.rollout --out folders rolled out with --record")
    parser.add_argument("--out", default="benchmarks/results/chunk_joins.json")
    args = parser.parse_args()
    results = [summarise(f) for f in args.rollouts]
    print("| rollout | episodes | success | join step: mean / p95 | chunk step: mean / p95 | lead at a join "
          "| lifted, not finished | of them dropped within 3 steps of a join |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rollout']} | {r['episodes']} | {r['successes']} | {r['join_step_mean']:.3f} / "
              f"{r['join_step_p95']:.3f} | {r['chunk_step_mean']:.3f} / {r['chunk_step_p95']:.3f} | "
              f"{r['lead_mean']:.3f} | {r['lifted_not_finished']} | {r['dropped_at_a_join']} |")
    write_json(args.out, {"results": results, "command": ["python", *sys.argv]})


if __name__ == "__main__":
    main()
