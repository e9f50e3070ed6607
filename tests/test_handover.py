"""benchmarks/handover.py: successes split into hand-overs and the left gripper alone, from a report's
rewards and from a demonstrations folder replayed in the simulator."""
import json
import subprocess
import sys

from tests.helpers import ROOT
from benchmarks.handover import (demo_rewards, expert_outcome, held_before_solved, report_episodes, split_by_expert,
                                 summarise)


def test_rewards_say_which_hand_solved():
    episodes = [[0, 1, 2, 2, 3, 4],   # held by the right gripper, then taken by the left: a hand-over
                [0, 0, 3, 4],         # the left gripper lifted it off the table alone
                [0, 1, 2, 1, 0],      # held, dropped, never solved
                [0, 0, 0]]            # never touched
    assert [held_before_solved(r) for r in episodes] == [True, False, True, False]
    assert summarise("x", episodes) == {"source": "x", "episodes": 4, "successes": 2, "by_handover": 1,
                                        "by_left_alone": 1, "held_by_right": 2}


def test_a_report_and_demonstrations_folders(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"results": {"policy": {"per_episode": [
        {"seed": 1000000, "success": True, "rewards": [0, 2, 4]}, {"seed": 1000001, "success": False, "rewards": [0, 1]}]}}}))
    assert [e["rewards"] for e in report_episodes(str(report))] == [[0, 2, 4], [0, 1]]
    # seed 2: the default expert's cube slips out of the right gripper and the left one lifts it off
    # the table alone; --expert-style handover_only points the right gripper at the cube and hands it over
    for flags, hand in (([], "by_left_alone"), (["--expert-style", "handover_only"], "by_handover")):
        demos = tmp_path / f"demos{len(flags)}"
        result = subprocess.run([sys.executable, "-m", "data.sim_demos", "--task", "transfer_cube", "--episodes", "1",
                                 "--out", str(demos), "--seed", "2", "--image-size", "16", "16", "--workers", "1",
                                 "--tail", "0", *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr
        (rewards,) = demo_rewards(str(demos))
        assert rewards[-1] == 4 and summarise("d", [rewards])[hand] == 1
        assert (2.0 in rewards) == bool(flags)


def test_episodes_split_by_what_the_expert_does_on_their_seed():
    episodes = [{"seed": 1, "success": True, "max_reward": 4}, {"seed": 2, "success": False, "max_reward": 2},
                {"seed": 3, "success": False, "max_reward": 0}, {"seed": 4, "success": True, "max_reward": 4},
                {"seed": 5, "success": False, "max_reward": 3}, {"seed": 6, "success": False, "max_reward": 1}]
    outcomes = {1: "by_handover", 2: "by_handover", 3: "by_left_alone", 4: "by_left_alone", 5: "by_left_alone",
                6: "fails"}
    rows = split_by_expert("r", episodes, outcomes)
    assert [(r["expert"], r["episodes"], r["successes"]) for r in rows] == [
        ("by_handover", 2, 1), ("by_left_alone", 3, 1), ("fails", 1, 0)]
    assert [[r[k] for k in ("never_touched", "touched", "lifted", "both_grippers")] for r in rows] == [
        [0, 0, 1, 0], [1, 0, 0, 1], [0, 1, 0, 0]]


def test_the_expert_outcome_of_known_seeds():
    # seeds 0 and 2 as in test_a_report_and_demonstrations_folders; on seed 21 (of 0-79 the only one)
    # every grasp depth the expert tries fails
    assert [expert_outcome(seed) for seed in (0, 2, 21)] == ["by_handover", "by_left_alone", "fails"]
