"""Which hand solved transfer_cube: successes by a hand-over, and by the left gripper alone.

    python benchmarks/handover.py [--reports RUN_DIR|REPORT.json ...] [--demos DIR ...] \
        [--out benchmarks/results/handover.json]

gym-aloha's top reward (4) pays the left gripper's finger on the cube with neither the table nor the
right gripper's finger on it. A left gripper that lifts a cube the right one dropped (or never
lifted) earns it too, so a success rate does not say whether the cube was handed over. The rewards
of each step do: a hand-over passes through reward 2 (the right gripper holds the cube off the
table) before reward 4 (`data.aloha_expert.handover_step`).

A rollout's report.json records each episode's rewards (`per_episode`); a run folder gives the
`checkpoint_step_N/eval/report.json` of each evaluated checkpoint. A demonstrations folder records
none, so each of its episodes' actions is replayed from its seed (meta/sim_demos.json) in the
simulator, unrendered. Printed, one row per report or folder: episodes, successes, those by a
hand-over and by the left gripper alone, and the episodes in which the right gripper held the cube
off the table (the hand-overs are those of them that succeeded). Written to OUT.
"""
import argparse
import json
import os
import sys
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.pose_coverage import report_paths  # noqa: E402
from data.aloha_expert import SOLVED, handover_step, held_before_solved, rewards_of  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


def summarise(name: str, episodes: Sequence[Sequence[float]]) -> dict[str, Any]:
    """`episodes`: the per-step rewards of each episode."""
    successes = sum(SOLVED in r for r in episodes)
    by_handover = sum(handover_step(r) >= 0 for r in episodes)  # = the episodes held that were solved
    return {"source": name, "episodes": len(episodes), "successes": successes, "by_handover": by_handover,
            "by_left_alone": successes - by_handover, "held_by_right": sum(held_before_solved(r) for r in episodes)}


def report_rewards(path: str) -> list[list[float]]:
    with open(path) as f:
        report = json.load(f)
    return [list(e["rewards"]) for e in report["results"]["policy"]["per_episode"]]


def demo_rewards(folder: str) -> list[list[float]]:
    """Each demonstration's actions replayed from its seed; the rewards up to its first 4."""
    from data.errors import DataError
    from data.lerobot_format import LeRobotSource
    from data.sim_demos import PROVENANCE
    from data.sim_env import make_env

    with open(os.path.join(folder, "meta", PROVENANCE)) as f:
        provenance = json.load(f)

    def bad(message: str) -> None:
        raise DataError(message)

    episodes = LeRobotSource(folder, 0, None, "action").load(bad)
    env = make_env(provenance["task"], (16, 16))
    return [rewards_of(env, seed, episode.action) for episode, seed in zip(episodes, provenance["seeds"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reports", nargs="*", default=[], help="run folders or rollout report.json files")
    parser.add_argument("--demos", nargs="*", default=[], help="folders data.sim_demos wrote")
    parser.add_argument("--out", default="benchmarks/results/handover.json")
    args = parser.parse_args()
    if not args.reports and not args.demos:
        parser.error("give --reports or --demos")
    rows = [summarise(p, report_rewards(p)) for p in report_paths(args.reports)]
    rows += [summarise(d, demo_rewards(d)) for d in args.demos]
    print("| source | episodes | success | by a hand-over | by the left gripper alone | held by the right gripper |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['episodes']} | {r['successes']} | {r['by_handover']} | {r['by_left_alone']} "
              f"| {r['held_by_right']} |")
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
