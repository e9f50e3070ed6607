"""benchmarks/chunk_start.py: the figures of one query are those of constructed chunks."""
import numpy as np
import pytest

from tests.helpers import ROOT  # noqa: F401  (puts the repository on sys.path)
from benchmarks.chunk_start import ARMS, query_figures


def test_a_chunk_one_step_ahead_of_the_expert_errs_by_one_step_and_the_grippers_do_not_count():
    steps = np.arange(40, dtype=np.float32)[:, None]
    expert = np.repeat(0.1 * steps, 14, axis=1)  # every joint moves 0.1 rad a step
    expert[:, [6, 13]] = 5.0 * steps             # the grippers: left out of every figure
    t = 8
    state = expert[t] - 0.2                      # the joints lag the target by two steps
    ahead = expert[t + 1:t + 17].copy()          # a chunk one step ahead of the expert's
    ahead[:, [6, 13]] = -100.0
    figures = query_figures(ahead, expert, state, t, [0, 4, 15])
    one_step = 0.1 * np.sqrt(len(ARMS))          # 0.1 rad on each of the twelve arm joints
    assert figures["error"] == pytest.approx({0: one_step, 4: one_step, 15: one_step}, rel=1e-5)
    assert figures["lead"] == pytest.approx(3 * one_step, rel=1e-5)
    assert figures["expert_lead"] == pytest.approx(2 * one_step, rel=1e-5)
    late = query_figures(ahead, expert, state, 30, [0, 9, 10])  # expert[40] does not exist: offset 10 left out
    assert sorted(late["error"]) == [0, 9]
