"""benchmarks/paired_rollouts.py: two rollouts compared seed by seed, the exact McNemar p-value that of
scipy's binomial test, and the command on two report files."""
import json
import subprocess
import sys

import pytest
from scipy.stats import binomtest

from tests.helpers import ROOT
from benchmarks.paired_rollouts import compare, mcnemar_exact


@pytest.mark.parametrize("gained,lost", [(24, 31), (22, 18), (28, 10), (0, 5), (7, 7), (1, 0), (60, 41)])
def test_mcnemar_is_the_binomial_test_of_the_discordant_seeds(gained, lost):
    want = binomtest(gained, gained + lost, 0.5, alternative="two-sided").pvalue
    assert mcnemar_exact(gained, lost) == pytest.approx(want, rel=1e-12)


def test_mcnemar_known_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)     # 2 * (1/2)^5
    assert mcnemar_exact(1, 3) == pytest.approx(10 / 16)    # 2 * (1 + 4) / 16


def episode(seed, max_reward):
    return {"seed": seed, "success": max_reward == 4, "max_reward": float(max_reward)}


BASE = [episode(10, 4), episode(11, 4), episode(12, 0), episode(13, 2), episode(14, 4), episode(15, 1)]
OTHER = [episode(11, 4), episode(12, 4), episode(13, 4), episode(14, 3), episode(15, 0), episode(16, 4)]


def test_paired_on_the_shared_seeds():
    got = compare(BASE, OTHER)
    assert (got["seeds"], got["first_seed"], got["last_seed"]) == (5, 11, 15)  # seeds 10 and 16 are not shared
    assert got["base"]["successes"] == 2 and got["other"]["successes"] == 3 and got["both"] == 1
    assert got["gained_seeds"] == [12, 13] and got["lost_seeds"] == [14]
    assert got["mcnemar_p"] == 1.0
    assert [got["base"][k] for k in ("never_touched", "touched", "lifted", "both_grippers")] == [1, 1, 1, 0]
    assert [got["other"][k] for k in ("never_touched", "touched", "lifted", "both_grippers")] == [1, 0, 0, 1]
    with pytest.raises(ValueError, match="share no seed"):
        compare(BASE[:1], OTHER[-1:])


def test_the_command_on_report_files_and_folders(tmp_path):
    for name, episodes in (("a", BASE), ("b", OTHER)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({"results": {"policy": {"per_episode": episodes}}}))
    out = tmp_path / "paired.json"
    result = subprocess.run([sys.executable, "benchmarks/paired_rollouts.py", str(tmp_path / "a"),
                             str(tmp_path / "b" / "report.json"), "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(out.read_text())
    assert (row["gained"], row["lost"], row["other"]["successes"]) == (2, 1, 3)
    assert "| 5 | 2 | 3 |" in result.stdout
    missing = subprocess.run([sys.executable, "benchmarks/paired_rollouts.py", str(tmp_path / "a"), str(tmp_path / "c")],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and f"{tmp_path / 'c'} does not exist" in missing.stderr
