"""benchmarks/act_vs_recipe.py: the recipe's saves placed on the CPU clock, the latest one under each of
ACT's marks, how each stands against ACT's, and rollouts on other seeds refused."""
import json
import subprocess
import sys

import pytest

from benchmarks.act_vs_recipe import act_curve, compare, recipe_curve
from checkpoint.layout import MARKER, PREFIX
from tests.helpers import ROOT

RULE = "reward 4: the left gripper holds the cube off the table"


def write_act(path, points, seeds=(1000000, 1000049)):
    rows = [{"cpu_minutes": m, "steps": s, "successes": k, "episodes": 50, "seeds": list(seeds)} for m, s, k in points]
    path.write_text(json.dumps({"success_rule": RULE, "rows": rows}))
    return str(path)


def write_run(run, successes, max_steps=4000, first_seed=1000000, unevaluated=(), trainer_states=None):
    """A run folder: config.yaml and a complete checkpoint every 1000 steps with the trainer's rollout
    (and `trainer_states[i]` as the i-th save's trainer_state.json, when given)."""
    run.mkdir()
    (run / "config.yaml").write_text(f"training:\n  max_steps: {max_steps}\n")
    for i, k in enumerate(successes):
        ckpt = run / f"{PREFIX}{1000 * (i + 1)}"
        (ckpt / "eval").mkdir(parents=True)
        (ckpt / MARKER).write_text("")
        if trainer_states is not None:
            (ckpt / "trainer_state.json").write_text(json.dumps(trainer_states[i]))
        if 1000 * (i + 1) in unevaluated:
            continue
        (ckpt / "eval" / "report.json").write_text(json.dumps({
            "seeds": list(range(first_seed, first_seed + 50)), "success_rule": RULE,
            "results": {"policy": {"success_rate": k / 50, "successes": k, "episodes": 50}}}))
    (run / f"{PREFIX}9999").mkdir()  # a save a kill interrupted (no marker): never read
    return str(run)


def test_each_mark_takes_the_latest_save_under_it(tmp_path):
    act, shared = act_curve(write_act(tmp_path / "act.json", [(10, 300, 2), (20, 600, 2), (30, 900, 1), (60, 1800, 3)]))
    assert shared == {"first_seed": 1000000, "last_seed": 1000049, "episodes": 50, "success_rule": RULE}
    # 2400 CPU-s over 4000 steps: a save every 10 CPU-minutes; step 3000 has no evaluation
    curve = recipe_curve(write_run(tmp_path / "run", [2, 15, 30, 40], unevaluated=(3000,)), 2400, shared)
    assert [(p["step"], p["cpu_minutes"], p["successes"]) for p in curve] == [(1000, 10, 2), (2000, 20, 15),
                                                                                (4000, 40, 40)]
    rows = compare(act, {"run": curve})
    got = [(r["cpu_minutes"], r["recipe"]["run"]["step"], r["recipe"]["run"]["standing"]) for r in rows]
    # 10: 2 against 2; 20: 15 against 2, the intervals (19-43%, 1-14%) apart; 30: step 2000 still;
    # 60: the run ended at 40, its last save stands
    assert got == [(10, 1000, "level"), (20, 2000, "ahead, apart"), (30, 2000, "ahead, apart"),
                   (60, 4000, "ahead, apart")]
    assert rows[0]["recipe"]["run"]["wilson_95"] == rows[0]["act"]["wilson_95"]

    early = compare([{**act[0], "cpu_minutes": 5}], {"run": curve})
    assert early[0]["recipe"]["run"] is None  # no save by 5 CPU-minutes
    behind = compare(act[:1], {"run": recipe_curve(write_run(tmp_path / "slow", [0, 9]), 2400, shared)})
    assert behind[0]["recipe"]["run"]["standing"] == "behind"  # 0 against 2, the intervals overlap


def test_the_trainer_s_clock_places_each_save(tmp_path):
    """Without CPU_S each save sits at the CPU seconds its trainer_state.json holds (uneven: the trainer
    counts what each stretch cost); a save counted from a resume, or from before the clock, is refused."""
    _, shared = act_curve(write_act(tmp_path / "act.json", [(10, 300, 2)]))
    states = [{"step": 1000 * (i + 1), "cpu_seconds": s, "cpu_seconds_since_step": 0} for i, s in
              enumerate([660.0, 1200.0, 1950.0])]
    curve = recipe_curve(write_run(tmp_path / "run", [2, 15, 30], trainer_states=states), None, shared)
    assert [(p["step"], p["cpu_minutes"]) for p in curve] == [(1000, 11), (2000, 20), (3000, 32.5)]
    late = [*states[:2], {**states[2], "cpu_seconds_since_step": 2500}]
    with pytest.raises(SystemExit, match="checkpoint_step_3000: the trainer's CPU time counts from step 2500"):
        recipe_curve(write_run(tmp_path / "resumed", [2, 15, 30], trainer_states=late), None, shared)
    old = [*states[:1], {"step": 2000, "samples_seen": 0, "skipped_nonfinite_steps": 0}]
    with pytest.raises(SystemExit, match="checkpoint_step_2000: saved before the trainer counted its CPU time"):
        recipe_curve(write_run(tmp_path / "old", [2, 15], trainer_states=old), None, shared)


def test_a_rollout_on_other_seeds_is_refused(tmp_path):
    _, shared = act_curve(write_act(tmp_path / "act.json", [(10, 300, 2)]))
    with pytest.raises(SystemExit, match="rolled out on .*first_seed': 1000050.*not comparable"):
        recipe_curve(write_run(tmp_path / "run", [2], first_seed=1000050), 600, shared)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty/config.yaml does not exist"):
        recipe_curve(str(tmp_path / "empty"), 600, shared)
    with pytest.raises(SystemExit, match="no checkpoint of .*unrolled has the trainer's evaluation"):
        recipe_curve(write_run(tmp_path / "unrolled", [2], unevaluated=(1000,)), 600, shared)
    mixed = write_act(tmp_path / "mixed.json", [(10, 300, 2)])
    record = json.loads(open(mixed).read())
    record["rows"].append({**record["rows"][0], "cpu_minutes": 20, "seeds": [1000050, 1000099]})
    (tmp_path / "mixed.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="different seeds"):
        act_curve(mixed)


def test_the_command_prints_the_table_and_refuses_a_bad_recipe(tmp_path):
    act = write_act(tmp_path / "act.json", [(10, 300, 2), (20, 600, 1)])
    run = write_run(tmp_path / "run_a", [3, 15], max_steps=2000)
    out = tmp_path / "cmp.json"
    result = subprocess.run([sys.executable, "benchmarks/act_vs_recipe.py", "--act", act, "--recipe", f"{run}=1200",
                             "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "| 20 | 600 | 1/50 (0.4-10.5%) | 2000, 15/50 (19.1-43.8%), ahead, apart |" in result.stdout
    written = json.loads(out.read_text())
    assert [p["cpu_minutes"] for p in written["recipe"]["run_a"]] == [10, 20]
    for bad, says in ((run, "checkpoint_step_1000/trainer_state.json does not exist"),
                      (f"{run}=-5", "expected a run folder, or RUN_DIR=CPU_SECONDS"),
                      (f"{tmp_path / 'nope'}=100", "is not a run folder")):
        refused = subprocess.run([sys.executable, "benchmarks/act_vs_recipe.py", "--act", act, "--recipe", bad],
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert refused.returncode != 0 and says in refused.stderr, refused.stderr
