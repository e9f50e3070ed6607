import math

import pytest
import torch
from omegaconf import OmegaConf

from recipe.schema import TrainingConfig
from utils.schedule import LRSchedule, linear_multiplier


def motus(s, W, C, f_start, f_max, f_min):
    if s <= 0:
        return f_start
    if s <= W:
        return f_start + (f_max - f_start) * s / W
    if s < C:
        return f_min + (f_max - f_min) * (C - s) / (C - W)
    return f_min


@pytest.mark.parametrize("s", [-1, 0, 1, 5, 10, 11, 50, 99, 100, 101, 500])
def test_linear_matches_motus_formula(s):
    assert linear_multiplier(s, 10, 100, 0.1, 0.99, 0.4) == pytest.approx(motus(s, 10, 100, 0.1, 0.99, 0.4), abs=0)


def make(**kw):
    return LRSchedule(OmegaConf.structured(TrainingConfig(**kw)))


def optimizer(lrs):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in lrs]
    opt = torch.optim.SGD([{"params": [p], "lr": lr, "initial_lr": lr} for p, lr in zip(params, lrs)])
    return opt


def test_first_update_uses_warmup_lr_and_groups_keep_base():
    sched = make(scheduler_type="linear", warmup_steps=4, cycle_length=20, f_start=0.0, f_max=1.0, f_min=0.1)
    opt = optimizer([1e-3, 2e-2])
    lrs = sched.apply(opt.param_groups)
    assert lrs == pytest.approx([1e-3 * 0.25, 2e-2 * 0.25])
    for _ in range(3):
        lrs = sched.apply(opt.param_groups)
    assert lrs == pytest.approx([1e-3, 2e-2])


def test_cosine_reaches_min_lr():
    sched = make(scheduler_type="cosine", warmup_steps=2, max_steps=10, learning_rate=1e-3, min_lr=1e-4)
    opt = optimizer([1e-3])
    lrs = [sched.apply(opt.param_groups)[0] for _ in range(10)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert lrs[-1] == pytest.approx(1e-4)
    mid = 2 + 4  # halfway through the decay
    assert lrs[mid - 1] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_constant_and_state_round_trip():
    sched = make(scheduler_type="constant")
    opt = optimizer([3e-4])
    assert sched.apply(opt.param_groups) == [3e-4]
    s2 = make(scheduler_type="linear", warmup_steps=4, cycle_length=20)
    for _ in range(7):
        s2.apply(opt.param_groups)
    s3 = make(scheduler_type="linear", warmup_steps=4, cycle_length=20)
    s3.load_state_dict(s2.state_dict())
    assert s3.apply(opt.param_groups) == s2.apply(optimizer([3e-4]).param_groups)


def test_linear_rejects_warmup_past_cycle():
    """The rule lives in the config checks (recipe/config.py), which run before anything is built."""
    from recipe.config import load_config
    from utils.config import ConfigError

    with pytest.raises(ConfigError, match="'training.warmup_steps' is 50; expected smaller than "
                                          r"training.cycle_length \(20\)"):
        load_config("configs/tiny.yaml", ["training.warmup_steps=50", "training.cycle_length=20"])
