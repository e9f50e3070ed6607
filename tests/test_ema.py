"""The EMA of the weights (train/ema.py) in one process: its schedule against an independent float64
recomputation from the raw weights of every step, the validation swap, and its checkpoint file.
The ZeRO-1/2 partitions at W=1 and W=2 are tested end to end in tests/test_train.py, their move to
another world size in tests/test_checkpoint_convert.py."""
import types

import pytest
import torch

from train.ema import EMA, decay_at, updates_at
from train.engine import load_named_ema, save_named_ema


def settings(decay=0.3, update_every=1, start_step=0):
    return types.SimpleNamespace(enabled=True, decay=decay, update_every=update_every, start_step=start_step)


def test_schedule():
    s = settings(decay=0.25, update_every=3, start_step=2)
    assert [step for step in range(1, 15) if updates_at(s, step)] == [2, 5, 8, 11, 14]
    assert [decay_at(s, n) for n in range(4)] == [0.0, 2 / 11, 0.25, 0.25]  # copy, warm-up, then the cap
    assert decay_at(settings(decay=0.9999), 990) == pytest.approx(991 / 1000)


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)  # frozen: not in the EMA
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)


def train_step(model, optimizer, step):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_ema_matches_a_recomputation_from_the_raw_weights():
    model, optimizer = model_and_optimizer()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    s = settings(decay=0.3, update_every=2, start_step=3)
    ema = EMA(s, [p for _, p in named])
    raw = {}
    for step in range(1, 12):
        train_step(model, optimizer, step)
        ema.update(step)
        raw[step] = {n: p.detach().double().clone() for n, p in named}
    # the reference: updates at steps 3, 5, 7, 9, 11; the first copies, then d = 2/11, 0.25, 0.3, 0.3
    reference, decays = dict(raw[3]), [2 / 11, 0.25, 0.3, 0.3]
    for step, d in zip((5, 7, 9, 11), decays):
        reference = {n: d * reference[n] + (1 - d) * raw[step][n] for n in reference}
    assert ema.updates == 5
    for (name, _), got in zip(named, ema.shadow):
        assert torch.allclose(got.double(), reference[name], rtol=0, atol=1e-6), name
        assert not torch.allclose(got.double(), raw[11][name], atol=1e-4), f"{name}: the EMA is not just the weights"


def test_swap_gives_the_model_the_ema_and_restores_it_exactly():
    model, optimizer = model_and_optimizer()
    params = [p for p in model.parameters() if p.requires_grad]
    ema = EMA(settings(), params)
    for step in (1, 2, 3):
        train_step(model, optimizer, step)
        ema.update(step)
    raw, average = [p.detach().clone() for p in params], [t.clone() for t in ema.shadow]
    x = torch.randn(2, 5)
    with ema.swapped_in():
        inside = model(x)
        assert all(torch.equal(p, a) for p, a in zip(params, average))
    assert all(torch.equal(p, r) for p, r in zip(params, raw))
    assert all(torch.equal(t, a) for t, a in zip(ema.shadow, average))
    assert not torch.equal(inside, model(x))


def test_the_loop_validates_with_the_ema_swapped_in_once_it_holds_an_average(monkeypatch):
    """train/validation.py validate_raw_and_ema: the raw weights, then `with engine.ema_swapped_in()` (val_ema_* keys);
    before the EMA's first update there is no average, and no second validation."""
    from train import validation as trainer

    model, optimizer = model_and_optimizer()
    params = [p for p in model.parameters() if p.requires_grad]
    ema = EMA(settings(), params)
    seen = []

    def validate(engine, *args):
        seen.append([p.detach().clone() for p in params])
        return {"loss": float(len(seen))}, "pictures"
    monkeypatch.setattr(trainer, "validate", validate)
    engine = types.SimpleNamespace(ema=ema, ema_swapped_in=ema.swapped_in)
    assert trainer.validate_raw_and_ema(engine, None, None, None, None) == ({"loss": 1.0}, "pictures")
    for step in (1, 2, 3):
        train_step(model, optimizer, step)
        ema.update(step)
    seen.clear()
    raw, average = [p.detach().clone() for p in params], [t.clone() for t in ema.shadow]
    assert trainer.validate_raw_and_ema(engine, None, None, None, None) == ({"loss": 1.0, "ema_loss": 2.0}, "pictures")
    assert all(torch.equal(a, b) for a, b in zip(seen[0], raw)) and all(torch.equal(a, b) for a, b in zip(seen[1], average))
    assert all(torch.equal(p, r) for p, r in zip(params, raw))  # swapped back


def test_saved_ema_loads_by_name_and_a_folder_without_one_is_reported(tmp_path):
    model, optimizer = model_and_optimizer()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ema = EMA(settings(), [p for _, p in named])
    for step in (1, 2):
        train_step(model, optimizer, step)
        ema.update(step)
    save_named_ema(ema, [n for n, _ in named], str(tmp_path))
    # another parameter order (like MuonAdamW's at another world size): restored by name
    again = EMA(settings(), [p for _, p in reversed(named)])
    assert load_named_ema(again, [n for n, _ in reversed(named)], str(tmp_path))
    assert again.updates == 2
    for a, b in zip(again.shadow, reversed(ema.shadow)):
        assert torch.equal(a, b)
    assert not load_named_ema(again, [n for n, _ in named], str(tmp_path / "elsewhere"))  # the engine restarts it


def test_non_fp32_masters_are_refused():
    with pytest.raises(ValueError, match="contiguous fp32 master weights, got torch.bfloat16"):
        EMA(settings(), [torch.zeros(3, dtype=torch.bfloat16)])
