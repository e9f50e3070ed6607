"""Two rollouts on the same seeds, compared seed by seed: is the difference more than chance?

    python benchmarks/paired_rollouts.py BASE OTHER [OTHER ...] [--out benchmarks/results/paired_rollouts.json]

BASE and each OTHER: a rollout's report.json, or the folder `inference.rollout --out` wrote it to
(the trainer's evaluations write theirs to `RUN/checkpoint_step_N/eval/`). Two checkpoints rolled
out on the same seeds meet the same cube poses, so their outcomes are paired: what tells them apart
is the seeds one solves and the other does not. For each OTHER against BASE, on the seeds both
rolled out: each one's successes (95% Wilson interval), the seeds OTHER gains and loses, and the
exact McNemar p-value, the chance that two equally good policies split the discordant seeds at
least as unevenly (two-sided binomial test at 1/2; the 100-demonstration pick against the 50's in
TRAINING.md: 28 gained, 10 lost, p = 0.005). Also how each one's failures ended, by the episode's
highest reward (transfer_cube's levels: never touched, touched, lifted, both grippers on the cube).
Printed as a table; written to OUT.
"""
import argparse
import json
import os
import sys
from math import comb
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.handover import FAILURE_ENDS, failure_ends, report_episodes  # noqa: E402
from benchmarks.results import write_json  # noqa: E402
from inference.rollout_report import wilson_interval  # noqa: E402


def report_path(given: str) -> str:
    path = os.path.join(given, "report.json") if os.path.isdir(given) else given
    if not os.path.isfile(path):
        raise SystemExit(f"paired_rollouts: {path} does not exist: give a rollout's report.json or its --out folder")
    return path


def mcnemar_exact(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value of `gained` against `lost` discordant pairs."""
    n, k = gained + lost, min(gained, lost)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n)


def outcome(successes: int, n: int, failed: list[dict[str, Any]]) -> dict[str, Any]:
    return {"successes": successes, "success_rate": successes / n, "wilson_95": wilson_interval(successes, n),
            **failure_ends(failed)}


def compare(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """`base`, `other`: a report's `per_episode` entries. The comparison on the seeds both hold."""
    a, b = {e["seed"]: e for e in base}, {e["seed"]: e for e in other}
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("the two reports share no seed: a paired comparison needs the same evaluation seeds")
    won = {s: (bool(a[s]["success"]), bool(b[s]["success"])) for s in seeds}
    gained = [s for s, (x, y) in won.items() if y and not x]
    lost = [s for s, (x, y) in won.items() if x and not y]
    n = len(seeds)
    return {"seeds": n, "first_seed": seeds[0], "last_seed": seeds[-1],
            "base": outcome(sum(x for x, _ in won.values()), n, [a[s] for s in seeds if not a[s]["success"]]),
            "other": outcome(sum(y for _, y in won.values()), n, [b[s] for s in seeds if not b[s]["success"]]),
            "both": sum(x and y for x, y in won.values()), "gained": len(gained), "lost": len(lost),
            "mcnemar_p": mcnemar_exact(len(gained), len(lost)), "gained_seeds": gained, "lost_seeds": lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", help="the reference rollout: report.json or its folder")
    parser.add_argument("others", nargs="+", help="rollouts compared with it")
    parser.add_argument("--out", default="benchmarks/results/paired_rollouts.json")
    args = parser.parse_args()
    base_path = report_path(args.base)
    base = report_episodes(base_path)
    rows = []
    for given in args.others:
        path = report_path(given)
        try:
            rows.append({"base_report": base_path, "report": path, **compare(base, report_episodes(path))})
        except ValueError as e:
            raise SystemExit(f"paired_rollouts: {base_path} and {path}: {e}")
    print(f"base: {base_path}\n\n| report | seeds | base | it | 95% Wilson | gained | lost | McNemar p "
          "| its failures: never touched / touched / lifted / both grippers |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["other"]["wilson_95"]
        ends = " / ".join(str(r["other"][end]) for end in FAILURE_ENDS)
        print(f"| {r['report']} | {r['seeds']} | {r['base']['successes']} | {r['other']['successes']} "
              f"| {100 * lo:.1f}-{100 * hi:.1f}% | {r['gained']} | {r['lost']} | {r['mcnemar_p']:.3f} | {ends} |")
    base_ends = " / ".join(str(rows[0]["base"][end]) for end in FAILURE_ENDS)
    print(f"\nthe base's failures: {base_ends}")
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
