"""benchmarks/pose_coverage.py: a seed's cube is where gym-aloha's own environment puts it, and the
distances and quartiles are those of the poses."""
import gymnasium as gym
import numpy as np
import pytest

from tests.helpers import ROOT  # noqa: F401  (puts the repository on sys.path)
from benchmarks.pose_coverage import coverage, cube_xy, parse_seeds


@pytest.mark.parametrize("seed", [0, 1000003])
def test_the_cube_is_where_gym_aloha_resets_it(seed):
    import gym_aloha  # noqa: F401  (registers the environments)

    env = gym.make("gym_aloha/AlohaTransferCube-v0", obs_type="pixels_agent_pos", observation_width=64, observation_height=48)
    try:
        env.reset(seed=seed)
        inner = env.unwrapped._env
        box = inner.task.get_env_state(inner.physics)[:3]
    finally:
        env.close()
    np.testing.assert_allclose(cube_xy(seed), box[:2], atol=1e-9)
    assert 0.0 <= box[0] <= 0.2 and 0.4 <= box[1] <= 0.6


def test_distances_and_quartiles():
    assert parse_seeds("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    train = [0, 1]
    episodes = [(0, True), (1, True), (1000000, False), (1000001, False)]
    got = coverage(train, episodes)
    trained = np.stack([cube_xy(0), cube_xy(1)])
    far = [np.min(np.linalg.norm(trained - cube_xy(s), axis=1)) for s in (1000000, 1000001)]
    assert got["mean_distance_cm_success"] == 0.0
    assert got["mean_distance_cm_failure"] == round(100 * float(np.mean(far)), 2)
    assert got["training_pose_spacing_cm_median"] == round(100 * float(np.linalg.norm(trained[0] - trained[1])), 2)
    assert [r["episodes"] for r in got["quartiles"]] == [1, 1, 1, 1]
    assert [r["successes"] for r in got["quartiles"]] == [1, 1, 0, 0]
