"""LeRobot's ACT and the recipe at equal training CPU: the two success curves side by side.

    python benchmarks/act_vs_recipe.py --act benchmarks/results/act_reference.json \
        --recipe runs/aloha_sim/RUN [--recipe RUN2=CPU_S ...] [--out benchmarks/results/act_vs_recipe.json]

ACT's curve is `act_reference.py run`'s JSON: a checkpoint saved at each CPU-minute mark of its
training, rolled out on the evaluation seeds. The recipe's is a run folder: the trainer's own
rollout of every save (`checkpoint_step_N/eval/report.json`), which must be on the same seeds
with the same success rule (checked), placed on the CPU clock by the trainer's own: each save's
`trainer_state.json` holds training's CPU seconds up to its step, every rank and its data-loader
workers, the rollouts beside it not counted (train/cpu_clock.py), as ACT's clock counts training
alone. A run saved before the trainer had that clock is given as RUN=CPU_S, the run's CPU seconds
(user + system of `train.sh`, e.g. bash's `time`) spread evenly over its `training.max_steps`: CPU_S
counts the evaluations too, so its saves are placed no earlier than they were reached. At each of
ACT's marks the recipe's row is its latest save at or under that many CPU-minutes, and a mark past a
run's end takes its last save (the run had stopped).

Prints one table (a row per mark: ACT's success, then each run's save and success, with its
95% Wilson interval and how it stands against ACT's: ahead, level or behind in successes, "apart"
when the two intervals do not overlap) and writes OUT with both curves in full.
"""
import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from benchmarks.results import write_json  # noqa: E402
from checkpoint.evaluations import read_report  # noqa: E402
from checkpoint.files import CONFIG_YAML  # noqa: E402
from checkpoint.layout import saved_steps  # noqa: E402
from inference.rollout_report import wilson_interval  # noqa: E402


def read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise SystemExit(f"act_vs_recipe: {path} does not exist")
    with open(path) as f:
        return json.load(f)


def point(successes: int, episodes: int, **extra: Any) -> dict[str, Any]:
    return {**extra, "successes": successes, "episodes": episodes, "wilson_95": wilson_interval(successes, episodes)}


def act_curve(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """ACT's points (CPU-minutes, steps, success) and what every rollout must share with them."""
    record = read_json(path)
    rows = record["rows"]
    if len({(tuple(r["seeds"]), r["episodes"]) for r in rows}) != 1:
        raise SystemExit(f"act_vs_recipe: {path}: its checkpoints were rolled out on different seeds")
    first, last = rows[0]["seeds"]
    return ([point(r["successes"], r["episodes"], cpu_minutes=r["cpu_minutes"], steps=r["steps"]) for r in rows],
            {"first_seed": first, "last_seed": last, "episodes": rows[0]["episodes"],
             "success_rule": record["success_rule"]})


def trainer_cpu_seconds(folder: str) -> float:
    """Training's CPU seconds up to this save, as the trainer counted them (trainer_state.json)."""
    state = read_json(os.path.join(folder, "trainer_state.json"))
    if "cpu_seconds" not in state or state.get("cpu_seconds_since_step", 0) != 0:
        since = state.get("cpu_seconds_since_step")
        raise SystemExit(f"act_vs_recipe: {folder}: " + (
            "saved before the trainer counted its CPU time" if since is None else
            f"the trainer's CPU time counts from step {since} (resumed from a save before the clock)") +
            "; give the run as RUN=CPU_S (its CPU seconds from bash's `time` around train.sh)")
    return float(state["cpu_seconds"])


def recipe_curve(run_dir: str, cpu_s: float | None, shared: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's evaluated saves, each at its CPU-minute (the trainer's clock, or `cpu_s` spread evenly
    over the steps); every rollout checked against ACT's seeds, episode count and success rule."""
    config = os.path.join(run_dir, CONFIG_YAML)
    if not os.path.isfile(config):
        raise SystemExit(f"act_vs_recipe: {config} does not exist: {run_dir} is not a run folder train.sh wrote")
    max_steps = int(OmegaConf.load(config).training.max_steps)
    curve = []
    for step, folder in saved_steps(run_dir):
        report = read_report(folder)  # the trainer's reading: None when missing or unreadable (warned)
        if report is None:
            continue
        policy = report["results"]["policy"]
        got = {"first_seed": report["seeds"][0], "last_seed": report["seeds"][-1], "episodes": policy["episodes"],
               "success_rule": report["success_rule"]}
        if got != shared:
            raise SystemExit(f"act_vs_recipe: {folder}'s evaluation was rolled out on {got}, ACT on {shared}: "
                             "not comparable")
        seconds = trainer_cpu_seconds(folder) if cpu_s is None else cpu_s * step / max_steps
        curve.append(point(policy["successes"], policy["episodes"], step=step, cpu_minutes=seconds / 60))
    if not curve:
        raise SystemExit(f"act_vs_recipe: no checkpoint of {run_dir} has the trainer's evaluation (eval/report.json)")
    return curve


def at_budget(curve: list[dict[str, Any]], minutes: float) -> dict[str, Any] | None:
    """The latest save at or under `minutes` CPU-minutes (None before the first)."""
    reached = [p for p in curve if p["cpu_minutes"] <= minutes + 1e-9]
    return reached[-1] if reached else None


def standing(recipe: dict[str, Any], act: dict[str, Any]) -> str:
    """ahead / level / behind in successes; 'apart' when the 95% intervals do not overlap."""
    diff = recipe["successes"] - act["successes"]
    word = "ahead" if diff > 0 else "behind" if diff < 0 else "level"
    (lo, hi), (act_lo, act_hi) = recipe["wilson_95"], act["wilson_95"]
    return word + (", apart" if lo > act_hi or hi < act_lo else "")


def compare(act: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per ACT mark: ACT's point and each run's latest save under it, with its standing."""
    rows = []
    for a in act:
        row: dict[str, Any] = {"cpu_minutes": a["cpu_minutes"], "act": a, "recipe": {}}
        for name, curve in runs.items():
            p = at_budget(curve, a["cpu_minutes"])
            row["recipe"][name] = None if p is None else {**p, "standing": standing(p, a)}
        rows.append(row)
    return rows


def cell(p: dict[str, Any] | None) -> str:
    if p is None:
        return "no save yet"
    lo, hi = p["wilson_95"]
    return f"{p['successes']}/{p['episodes']} ({100 * lo:.1f}-{100 * hi:.1f}%)"


def table(rows: list[dict[str, Any]]) -> str:
    names = list(rows[0]["recipe"])
    lines = ["| CPU-min | ACT step | ACT success | " + " | ".join(f"{n}: step, success, vs ACT" for n in names) + " |",
             "|---" * (3 + len(names)) + "|"]
    for r in rows:
        runs = []
        for n in names:
            p = r["recipe"][n]
            runs.append("-" if p is None else f"{p['step']}, {cell(p)}, {p['standing']}")
        lines.append(f"| {r['cpu_minutes']:g} | {r['act']['steps']} | {cell(r['act'])} | " + " | ".join(runs) + " |")
    return "\n".join(lines)


def parse_recipe(given: str) -> tuple[str, float | None]:
    """RUN_DIR -> (RUN_DIR, None): the trainer's clock; RUN_DIR=CPU_SECONDS -> (RUN_DIR, seconds)."""
    if os.path.isdir(given):
        return given, None
    run_dir, sep, cpu = given.rpartition("=")
    try:
        cpu_s = float(cpu)
    except ValueError:
        cpu_s = -1.0
    if not sep or cpu_s <= 0:
        raise SystemExit(f"act_vs_recipe: --recipe {given!r}: expected a run folder, or RUN_DIR=CPU_SECONDS "
                         "(a positive number)")
    if not os.path.isdir(run_dir):
        raise SystemExit(f"act_vs_recipe: --recipe {given!r}: {run_dir} is not a run folder")
    return run_dir, cpu_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--act", required=True, help="act_reference.py run's JSON (OUT.json)")
    p.add_argument("--recipe", action="append", required=True,
                   help="RUN_DIR (its saves' own CPU clock) or RUN_DIR=CPU_SECONDS, once per run")
    p.add_argument("--out", default="benchmarks/results/act_vs_recipe.json")
    args = p.parse_args()
    act, shared = act_curve(args.act)
    runs = {}
    for given in args.recipe:
        run_dir, cpu_s = parse_recipe(given)
        runs[os.path.basename(run_dir.rstrip("/"))] = recipe_curve(run_dir, cpu_s, shared)
    rows = compare(act, runs)
    print(f"transfer_cube, seeds {shared['first_seed']}-{shared['last_seed']}, {shared['success_rule']}")
    print(table(rows))
    write_json(args.out, {"evaluation": shared, "act": act, "recipe": runs, "rows": rows})


if __name__ == "__main__":
    main()
