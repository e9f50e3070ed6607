"""The registry of checkpoint parts (checkpoint/state.py): a part registered once is saved and restored by
the checkpointer, which knows nothing about it; the trainer's parts (train/train.py `checkpoint_parts`)
round-trip exactly, and a checkpoint records its world size once, in its manifest."""
import json
import os
import types

import pytest
import torch
from omegaconf import OmegaConf

import checkpoint.checkpointer as ck
from checkpoint.manifest import MANIFEST
from checkpoint.state import Document, PerRank, RandomState, Registry, Shared
from recipe.schema import Config

GOOD = {"weights_finite": True, "loss_finite": True}


class Counter:
    """A part the checkpointer has never heard of."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def config(*overrides):
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(overrides)))
    cfg.system.total_limit = None
    return cfg


def test_a_new_part_registered_once_is_saved_and_restored(tmp_path):
    saved, kept = Counter(41), Counter(7)
    parts = Registry()
    parts.register("counter", Shared(saved))
    parts.register("kept", Shared(kept), restore=False)
    parts.register("rng", PerRank(RandomState()))
    parts.register("notes.txt", Document(lambda path: open(path, "w").write("hello")))
    with pytest.raises(ValueError, match="checkpoint part 'counter' is registered twice"):
        parts.register("counter", Shared(Counter()))
    torch.manual_seed(3)
    path = ck.Checkpointer(str(tmp_path), config()).save(5, parts, GOOD)
    expected = torch.rand(4)  # the draws after the save
    assert sorted(os.listdir(path)) == ["COMPLETE", MANIFEST, "counter.json", "kept.json", "notes.txt", "rng"]
    assert ck.verify(path) == []

    torch.manual_seed(99)
    restored, untouched = Counter(), Counter(-1)
    again = Registry()
    again.register("counter", Shared(restored))
    again.register("kept", Shared(untouched), restore=False)
    again.register("rng", PerRank(RandomState()))
    again.register("notes.txt", Document(lambda path: None))
    ck.Checkpointer(str(tmp_path), config()).load(path, again)
    assert restored.value == 41 and untouched.value == -1
    assert torch.equal(torch.rand(4), expected)  # this rank's RNG continues where the save left it


class Accelerator:
    """What the DDP engine asks of accelerate in one process: no wrapper, the CPU."""
    state = types.SimpleNamespace(deepspeed_plugin=None)
    device = torch.device("cpu")
    is_main_process = True

    @staticmethod
    def prepare(model, optimizer):
        return model, optimizer


def trainer_parts(seed):
    """The trainer's own registry over a small DDP engine (EMA on), a stream, a schedule, the stats."""
    from data.stream import TrainStream
    from train.launch import make_engine
    from train.trainer_state import TrainerState
    from train.train import checkpoint_parts
    from utils.schedule import LRSchedule

    cfg = config("training.ema.enabled=true", "training.ema.start_step=0", "training.ema.update_every=1")
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    engine = make_engine(Accelerator(), model, optimizer, cfg)
    stats = types.SimpleNamespace(save=lambda path: open(path, "w").write("{}"))
    state, stream, schedule = TrainerState(), TrainStream(None, 0, batch_size=2, world_size=1), LRSchedule(cfg.training)
    return cfg, engine, state, stream, schedule, checkpoint_parts(cfg, engine, state, stream, schedule, stats)


def test_the_trainers_parts_round_trip_and_the_world_size_is_stored_once(tmp_path):
    cfg, engine, state, stream, schedule, parts = trainer_parts(seed=0)
    for step in (1, 2):
        schedule.apply(engine.param_groups)
        engine.unwrapped_model()(torch.randn(4, 3)).pow(2).mean().backward()
        engine.optimizer_step(step)  # and the EMA's update
        stream.batches += 1  # one batch of 2 drawn
        state.step, state.samples_seen = step, step * 2
    path = ck.Checkpointer(str(tmp_path), cfg).save(2, parts, GOOD)

    files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    holding = [os.path.relpath(f, path) for f in files if b"world_size" in open(f, "rb").read()]
    assert holding == [MANIFEST] and open(os.path.join(path, MANIFEST)).read().count('"world_size"') == 1
    assert json.load(open(os.path.join(path, MANIFEST)))["world_size"] == 1 == ck.saved_world_size(path)

    _, fresh, fresh_state, fresh_stream, fresh_schedule, fresh_parts = trainer_parts(seed=1)
    ck.Checkpointer(str(tmp_path), cfg).load(path, fresh_parts)
    assert fresh_state == state and fresh_schedule.last_step == 2 and fresh_stream.samples_consumed() == 4
    for a, b in zip(fresh.unwrapped_model().parameters(), engine.unwrapped_model().parameters()):
        assert torch.equal(a, b)
    for a, b in zip(fresh.ema.shadow, engine.ema.shadow):
        assert torch.equal(a, b)
    assert fresh.ema.updates == 2
    saved_state = [v for s in engine.base_optimizer.state.values() for v in s.values()]
    loaded_state = [v for s in fresh.base_optimizer.state.values() for v in s.values()]
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(saved_state, loaded_state))
    assert len(saved_state) == len(loaded_state) == 6
