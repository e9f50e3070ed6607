"""benchmarks/action_attention.py: the cube's token, the action tokens' attention on the condition frame
and the figures drawn from it are those of constructed inputs."""
import math

import numpy as np
import pytest
import torch

from tests.helpers import ROOT  # noqa: F401  (puts the repository on sys.path)
from benchmarks.action_attention import action_query_attention, cube_token, layer_figures, recorded_attention


def test_the_cube_token_is_the_grid_cell_under_the_red_centroid():
    frame = np.full((192, 256, 3), 128, np.uint8)
    assert cube_token(frame, (12, 16)) is None
    frame[100:106, 40:46] = (220, 20, 20)  # centroid (102.5, 42.5): row 102.5 * 12 / 192 = 6.4, column 2.66
    assert cube_token(frame, (12, 16)) == (6, 2)
    assert cube_token(frame[::-1], (12, 16)) == (5, 2)  # a flipped (negative-stride) frame, as the renderer gives


def test_action_query_attention_is_the_action_queries_softmax_over_every_key():
    torch.manual_seed(0)
    num_video, num_action, num_und, heads, dim = 12, 3, 2, 2, 8
    q, k = torch.randn(2, num_video + num_action + num_und, heads, dim), torch.randn(2, 17, heads, dim)
    q[:, num_video:num_video + num_action, 0] = 0
    q[:, num_video:num_video + num_action, 0, 0] = 40.0
    k[:, :, 0, 0] = -1.0
    k[:, 4, 0, 0] = 1.0  # head 0 of every action query on condition token 4 alone
    got = action_query_attention(q, k, None, num_video, num_action)
    assert got.shape == (2, heads, 17)
    assert float(got[:, 0, 4].min()) > 0.999
    probs = (q[:, num_video:num_video + num_action].transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(dim)).softmax(-1)
    assert torch.allclose(got[:, 1], probs[:, 1].mean(1), atol=1e-6)
    mask = torch.ones(2, 1, 1, 17, dtype=torch.bool)
    mask[1, ..., -1] = False  # a padded understanding token takes no weight
    masked = action_query_attention(q, k, mask, num_video, num_action)
    assert torch.equal(masked[0], got[0]) and float(masked[1, :, -1].max()) == 0.0
    assert torch.allclose(masked[1].sum(-1), torch.ones(heads)) and float((masked[1, 1, :-1] - got[1, 1, :-1]).min()) > 0


def test_recorded_attention_sees_every_joint_attention_and_changes_none():
    from models import joint

    q, k, v = (torch.randn(1, 10, 2, 4) for _ in range(3))
    expected = joint.attention(q, k, v, None)
    with recorded_attention(num_video=6, num_action=2) as calls:
        out = joint.attention(q, k, v, None)
        joint.attention(q, k, v, None)
    assert torch.equal(out, expected) and len(calls) == 2 and calls[0].shape == (1, 2, 10)
    assert joint.attention(q, k, v, None) is not None and len(calls) == 2  # removed on exit


def test_layer_figures_lift_and_peak():
    grid = (3, 4)  # 12 condition tokens, 12 predicted, 2 action tokens, 1 understanding token
    weights = torch.full((2, 2, 2, 27), 0.01)  # [steps, seeds, heads, S]
    weights[:, 0, :, 5] = 0.12                 # seed 0: both heads peak on its cube's token (1, 1)
    weights[:, 1, 0, 11] = 0.12                # seed 1: head 0 peaks at (2, 3), 2 columns from its cube (2, 1)
    weights[:, :, :, 24:26] = 0.2              # the action tokens
    figures = layer_figures(weights, [(1, 1), (2, 1)], grid, num_video=24, num_action=2)
    assert figures["predicted"] == pytest.approx(0.12) and figures["actions"] == pytest.approx(0.4)
    assert figures["frame0"] == pytest.approx((0.23 * 3 + 0.12) / 4)
    assert figures["cube"] == pytest.approx((0.12 * 2 + 0.01 * 2) / 4)
    # lift: the cube's share over the mean token share of its seed and head
    lifts = [0.12 / (0.23 / 12)] * 2 + [0.01 / (0.23 / 12), 0.01 / (0.12 / 12)]
    assert figures["lift"] == pytest.approx(sum(lifts) / 4)
    # peak: seed 0's heads on the cube; seed 1's head 0 two columns off, head 1 flat (argmax token 0: (0, 0), off)
    assert figures["peak"] == pytest.approx(0.5)
