"""benchmarks/chunk_joins.py: the figures of constructed recorded episodes, and a rollout folder read whole."""
import json

import numpy as np
import pytest

from tests.helpers import ROOT  # noqa: F401  (puts the repository on sys.path)
from benchmarks.chunk_joins import ARMS, episode_figures, summarise


def constructed(steps=12, chunk=4, jump=0.3):
    """Every arm joint moves 0.05 rad a step; each new chunk starts `jump` further on; the state lags 0.1."""
    actions = np.repeat(0.05 * np.arange(steps, dtype=np.float32)[:, None], 14, axis=1)
    for t in range(chunk, steps, chunk):
        actions[t:, ARMS] += jump
    actions[:, [6, 13]] = np.arange(steps)[:, None] * 3.0  # the grippers: left out of every figure
    states = actions - 0.1
    return actions, states, np.arange(0, steps, chunk)


def test_join_steps_chunk_steps_and_leads_of_a_constructed_episode():
    actions, states, queries = constructed()
    figures = episode_figures(actions, states, queries)
    assert figures["join"] == pytest.approx([0.35, 0.35], rel=1e-5)       # a step's 0.05 plus the 0.3 jump, at steps 4, 8
    assert figures["chunk"] == pytest.approx([0.05] * 9, rel=1e-5)        # the other 9 of the 11 steps
    assert figures["lead"] == pytest.approx([0.1 * np.sqrt(12)] * 2, rel=1e-5)


def test_a_rollout_folder_counts_drops_at_a_join(tmp_path):
    rows = []
    for seed, (rewards, success) in enumerate([([1, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0], False),   # lost at step 5: join 4
                                               ([0, 0, 2, 2] + [0] * 8, False),                 # lost at 3: before one
                                               ([0, 1, 2, 3, 4] + [4] * 7, True)]):
        actions, states, queries = constructed()
        np.savez(tmp_path / f"policy_seed{seed}.npz", actions=actions, states=states, queries=queries,
                 rewards=np.asarray(rewards, np.float64))
        rows.append({"seed": seed, "success": success, "max_reward": max(rewards), "rewards": rewards,
                     "record": f"policy_seed{seed}.npz"})
    rows.append({"seed": 9, "success": False, "max_reward": 2, "rewards": [2]})  # not recorded: not read
    (tmp_path / "report.json").write_text(json.dumps({"results": {"policy": {"per_episode": rows}}}))
    got = summarise(str(tmp_path))
    assert (got["episodes"], got["successes"], got["lifted_not_finished"]) == (3, 1, 2)
    assert got["last_lifted_steps"] == [3, 5] and got["dropped_at_a_join"] == 1
    assert got["join_step_mean"] == pytest.approx(0.35, rel=1e-5) and got["chunk_step_mean"] == pytest.approx(0.05, rel=1e-5)
    with pytest.raises(SystemExit, match="no recorded episode; roll out with --record N"):
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "report.json").write_text(json.dumps({"results": {"policy": {"per_episode": rows[-1:]}}}))
        summarise(str(empty))
