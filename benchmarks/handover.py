"""Which hand solved transfer_cube: successes by a hand-over, and by the left gripper alone.

    python benchmarks/handover.py [--reports RUN_DIR|REPORT.json ...] [--demos DIR ...] \
        [--by-expert] [--workers N] [--out benchmarks/results/handover.json]

gym-aloha's top reward (4) pays the left gripper's finger on the cube with neither the table nor the
right gripper's finger on it. A left gripper that lifts a cube the right one dropped (or never
lifted) earns it too, so a success rate does not say whether the cube was handed over. The rewards
of each step do: a hand-over passes through reward 2 (the right gripper holds the cube off the
table) before reward 4 (`data.aloha_expert.handover_step`).

A rollout's report.json records each episode's rewards (`per_episode`); a run folder gives the
`checkpoint_step_N/eval/report.json` of each evaluated checkpoint. A demonstrations folder records
none, so each of its episodes' actions is replayed from its seed (meta/sim_demos.json) in the
simulator, unrendered (for a folder made with --action-noise, with the offset each episode was
executed with: `data.sim_demos.executed_actions` of its seed and recorded draw). Printed, one row per report or folder: episodes, successes, those by a
hand-over and by the left gripper alone, and the episodes in which the right gripper held the cube
off the table (the hand-overs are those of them that succeeded). Written to OUT.

`--by-expert` asks whether the policy fails where its teacher does: the scripted expert
(`data.aloha_expert.expert_trajectory`, the one `data.sim_demos` writes by default) is replayed on each
report episode's seed, and the report's episodes are split by what it does there (a hand-over, the left
gripper alone, or no success), each group with the policy's successes and how its failures ended
(`max_reward`: never touched, touched, lifted, both grippers on the cube). The expert is replayed
unrendered: about 0.3 CPU-s a seed.
"""
import argparse
import json
import multiprocessing
import os
import sys
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.pose_coverage import report_paths  # noqa: E402
from data.aloha_expert import SOLVED, expert_replayed, handover_step, held_before_solved, rewards_of  # noqa: E402
from benchmarks.results import write_json  # noqa: E402

OUTCOMES = ("by_handover", "by_left_alone", "fails")
"""What an episode's rewards say (`solved_by`)."""


def solved_by(rewards: Sequence[float]) -> str:
    """One of OUTCOMES: solved by a hand-over, by the left gripper alone, or not solved."""
    return "by_handover" if handover_step(rewards) >= 0 else "by_left_alone" if SOLVED in rewards else "fails"


def summarise(name: str, episodes: Sequence[Sequence[float]]) -> dict[str, Any]:
    """`episodes`: the per-step rewards of each episode."""
    outcomes = [solved_by(r) for r in episodes]
    return {"source": name, "episodes": len(episodes), "successes": len(episodes) - outcomes.count("fails"),
            "by_handover": outcomes.count("by_handover"), "by_left_alone": outcomes.count("by_left_alone"),
            "held_by_right": sum(held_before_solved(r) for r in episodes)}


def report_episodes(path: str) -> list[dict[str, Any]]:
    """The policy's `per_episode` entries of a rollout's report.json."""
    with open(path) as f:
        return list(json.load(f)["results"]["policy"]["per_episode"])


def demo_rewards(folder: str) -> list[list[float]]:
    """Each demonstration's actions replayed from its seed, as they were executed; the rewards up to its
    first 4."""
    from data.errors import DataError
    from data.lerobot_format import LeRobotSource
    from data.sim_demos import PROVENANCE, executed_actions
    from data.sim_env import make_env

    with open(os.path.join(folder, "meta", PROVENANCE)) as f:
        provenance = json.load(f)

    def bad(message: str) -> None:
        raise DataError(message)

    episodes = LeRobotSource(folder, 0, None, "action").load(bad)
    env = make_env(provenance["task"], (16, 16))
    noise = provenance.get("action_noise") or 0.0  # absent in folders written before --action-noise
    draws = provenance.get("noise_draws") or [-1] * len(episodes)  # null without --action-noise: no draw (-1)
    return [rewards_of(env, seed, executed_actions(episode.action, seed, noise, draw))
            for episode, seed, draw in zip(episodes, provenance["seeds"], draws)]


FAILURE_ENDS = ("never_touched", "touched", "lifted", "both_grippers")
"""How a failed episode ended, by its highest reward (0-3): gym-aloha's transfer_cube levels."""


def failure_ends(failed: Sequence[dict[str, Any]]) -> dict[str, int]:
    """How many of the `failed` report episodes ended at each of FAILURE_ENDS."""
    return {end: sum(int(e["max_reward"]) == level for e in failed) for level, end in enumerate(FAILURE_ENDS)}


def expert_outcome(seed: int, task: str = "transfer_cube") -> str:
    """What the default scripted expert does on `seed`: one of OUTCOMES (from the rewards of the
    replay with which the expert checks its own trajectory)."""
    return solved_by(expert_replayed(task, seed)[1])


def split_by_expert(name: str, per_episode: Sequence[dict[str, Any]], outcomes: dict[int, str]) -> list[dict[str, Any]]:
    """The report's episodes grouped by the expert's outcome on their seed (`outcomes`)."""
    rows = []
    for outcome in OUTCOMES:
        group = [e for e in per_episode if outcomes[e["seed"]] == outcome]
        failed = [e for e in group if not e["success"]]
        rows.append({"source": name, "expert": outcome, "episodes": len(group),
                     "successes": len(group) - len(failed), **failure_ends(failed)})
    return rows


def by_expert(reports: dict[str, list[dict[str, Any]]], workers: int) -> list[dict[str, Any]]:
    """`reports`: each report's path and its `per_episode` entries."""
    seeds = sorted({e["seed"] for episodes in reports.values() for e in episodes})
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        outcomes = dict(zip(seeds, pool.map(expert_outcome, seeds)))
    rows = [row for path, episodes in reports.items() for row in split_by_expert(path, episodes, outcomes)]
    print("\n| source | the expert on the seed | episodes | success | never touched | touched | lifted "
          "| both grippers |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['expert']} | {r['episodes']} | {r['successes']} | "
              + " | ".join(str(r[end]) for end in FAILURE_ENDS) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reports", nargs="*", default=[], help="run folders or rollout report.json files")
    parser.add_argument("--demos", nargs="*", default=[], help="folders data.sim_demos wrote")
    parser.add_argument("--by-expert", action="store_true",
                        help="also split the reports' episodes by what the scripted expert does on their seeds")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes replaying the expert")
    parser.add_argument("--out", default="benchmarks/results/handover.json")
    args = parser.parse_args()
    if not args.reports and not args.demos:
        parser.error("give --reports or --demos")
    if args.by_expert and not args.reports:
        parser.error("--by-expert splits the episodes of --reports")
    reports = {path: report_episodes(path) for path in report_paths(args.reports)}
    rows = [summarise(path, [list(e["rewards"]) for e in episodes]) for path, episodes in reports.items()]
    rows += [summarise(d, demo_rewards(d)) for d in args.demos]
    print("| source | episodes | success | by a hand-over | by the left gripper alone | held by the right gripper |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['episodes']} | {r['successes']} | {r['by_handover']} | {r['by_left_alone']} "
              f"| {r['held_by_right']} |")
    expert_rows = by_expert(reports, args.workers) if args.by_expert else []
    write_json(args.out, {"sources": rows, "by_expert": expert_rows})


if __name__ == "__main__":
    main()
