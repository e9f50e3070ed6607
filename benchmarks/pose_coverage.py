"""Do the policy's failures sit between the demonstrations' cube poses? (The demo-density question.)

    python benchmarks/pose_coverage.py --reports RUN_DIR [REPORT.json ...] [--demos assets/aloha_demos50] \
        [--demo-seeds 0-20,22-50] [--val-fraction 0.1] [--out benchmarks/results/pose_coverage.json]

gym-aloha places transfer_cube's cube from the episode's seed alone (`gym_aloha.utils.sample_box_pose`:
x uniform in [0, 0.2] m, y in [0.4, 0.6] m), so the seeds of a rollout report and of a demonstrations
folder give every cube's start without running the simulator. The demonstrations' seeds are read from
DEMOS/meta/sim_demos.json (`data.sim_demos` writes it) or given with --demo-seeds; the policy trained
on all but the last --val-fraction of them (the recipe's `dataset.val_fraction`, the split of
data/episodes.py). For each evaluated episode: the distance from its cube to the nearest cube the
policy was trained on. Printed: success by quartile of that distance (with 95% Wilson intervals) and
the mean distance of successes and failures, over every report given together (a run folder gives the
`checkpoint_step_N/eval/report.json` of each evaluated checkpoint); written to OUT.
"""
import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.episodes import split_episodes  # noqa: E402
from data.sim_demos import PROVENANCE  # noqa: E402
from inference.rollout_report import wilson_interval  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


X_RANGE, Y_RANGE = (0.0, 0.2), (0.4, 0.6)  # gym_aloha.utils.sample_box_pose, metres


def cube_xy(seed: int) -> np.ndarray:
    """transfer_cube's cube (x, y) for `seed`, as gym-aloha's reset draws it (its own function)."""
    from gym_aloha.utils import sample_box_pose

    return np.asarray(sample_box_pose(seed)[:2], dtype=np.float64)


def parse_seeds(spec: str) -> list[int]:
    """'0-20,22-50' -> [0, ..., 20, 22, ..., 50]."""
    seeds: list[int] = []
    for part in spec.split(","):
        low, _, high = part.strip().partition("-")
        seeds += list(range(int(low), int(high or low) + 1))
    return seeds


def demo_seeds(demos: str, spec: str | None) -> list[int]:
    path = os.path.join(demos, "meta", PROVENANCE)
    if spec:
        return parse_seeds(spec)
    if not os.path.exists(path):
        raise SystemExit(f"pose_coverage: {path} does not exist (a folder written before data.sim_demos recorded "
                         "its seeds): give them with --demo-seeds, e.g. 0-20,22-50")
    with open(path) as f:
        return list(json.load(f)["seeds"])


def report_paths(given: list[str]) -> list[str]:
    paths: list[str] = []
    for item in given:
        if os.path.isdir(item):
            found = sorted(glob.glob(os.path.join(item, "checkpoint_step_*", "eval", "report.json")))
            if not found:
                raise SystemExit(f"no checkpoint_step_N/eval/report.json under '{item}': give a run folder or report.json files")
            paths += found
        else:
            paths.append(item)
    return paths


def episodes_of(paths: list[str]) -> list[tuple[int, bool]]:
    """(seed, success) of every policy episode of the reports."""
    found = []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        found += [(int(e["seed"]), bool(e["success"])) for e in report["results"]["policy"]["per_episode"]]
    return found


def coverage(train_seeds: list[int], episodes: list[tuple[int, bool]]) -> dict:
    trained = np.stack([cube_xy(s) for s in train_seeds])
    distance = np.array([np.min(np.linalg.norm(trained - cube_xy(seed), axis=1)) for seed, _ in episodes])
    success = np.array([ok for _, ok in episodes])
    rows = []  # quartiles by rank (ties split by seed order): four groups of equal size
    for q, group in enumerate(np.array_split(np.argsort(distance, kind="stable"), 4)):
        n, k = len(group), int(np.sum(success[group]))
        rows.append({"quartile": q + 1, "episodes": n, "successes": k, "success_rate": k / n if n else None,
                     "distance_cm": [round(100 * float(distance[group].min()), 2),
                                     round(100 * float(distance[group].max()), 2)] if n else None,
                     "wilson_95": wilson_interval(k, n) if n else None})
    spacing = [np.min(np.linalg.norm(np.delete(trained, i, axis=0) - trained[i], axis=1)) for i in range(len(trained))]
    return {"training_poses": len(train_seeds), "episodes": len(episodes), "successes": int(success.sum()),
            "training_pose_spacing_cm_median": round(100 * float(np.median(spacing)), 2),
            "mean_distance_cm_success": round(100 * float(distance[success].mean()), 2) if success.any() else None,
            "mean_distance_cm_failure": round(100 * float(distance[~success].mean()), 2) if (~success).any() else None,
            "quartiles": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reports", nargs="+", required=True, help="run folders or rollout report.json files")
    parser.add_argument("--demos", default="assets/aloha_demos50")
    parser.add_argument("--demo-seeds", default=None, help="the folder's episode seeds in order, e.g. 0-20,22-50")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the run's dataset.val_fraction")
    parser.add_argument("--out", default="benchmarks/results/pose_coverage.json")
    args = parser.parse_args()
    seeds = demo_seeds(args.demos, args.demo_seeds)
    train, _ = split_episodes(range(len(seeds)), None, args.val_fraction)
    paths = report_paths(args.reports)
    result = {"reports": paths, "demos": args.demos, "train_seeds": [seeds[i] for i in train],
              **coverage([seeds[i] for i in train], episodes_of(paths))}
    print(f"{result['episodes']} episodes of {len(paths)} reports, {result['successes']} successes; "
          f"{result['training_poses']} training poses, median spacing {result['training_pose_spacing_cm_median']} cm")
    print("| distance to the nearest training cube | episodes | success | 95% Wilson |\n|---|---|---|---|")
    for row in result["quartiles"]:
        low, high = row["distance_cm"]
        rate = f"{row['successes']} ({row['success_rate']:.0%})" if row["episodes"] else "-"
        ci = "-".join(f"{100 * v:.1f}" for v in row["wilson_95"]) + "%" if row["episodes"] else ""
        print(f"| {low:.2f}-{high:.2f} cm | {row['episodes']} | {rate} | {ci} |")
    print(f"mean distance: successes {result['mean_distance_cm_success']} cm, failures "
          f"{result['mean_distance_cm_failure']} cm")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
