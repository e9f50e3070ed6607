"""Test launcher (torchrun starts it instead of train/train.py): the real trainer, with one rank's loss
made non-finite at chosen steps, and every rank's weights and optimizer state compared across them.

POISON="3:add,4:mul" poisons the loss of rank POISON_RANK at step 3 with `loss + nan` (its gradients
stay finite: only the loss check can catch it) and at step 4 with `loss * nan` (NaN gradients).
Each rank writes POISON_OUT/rank_R.json: per step, whether the engine skipped it and whether the
model parameters, the optimizer's own (fp32 master) parameters and its state are bit-identical
before and after the step. Kept under tests/: the product code has no hook for this.
"""
import atexit
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train.ddp_engine import DDPEngine  # noqa: E402
from train.deepspeed_engine import DeepSpeedEngine  # noqa: E402
from train import train as trainer  # noqa: E402

RANK = int(os.environ.get("RANK", 0))
POISON = dict(item.split(":") for item in os.environ["POISON"].split(","))
POISON_RANK = int(os.environ.get("POISON_RANK", 1))
WATCH = {int(s) for s in POISON} | {int(s) + 1 for s in POISON}  # + the step after: it must change
results, current = [], {"step": 1, "before": None}


def _tensors(engine):
    params = [p.detach().clone() for p in engine.unwrapped_model().parameters()]
    master = [p.detach().clone() for g in engine.base_optimizer.param_groups for p in g["params"]]
    state = [v.detach().clone() for s in engine.base_optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": params, "master": master, "state": state}


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


ORIGINAL = {cls: (cls.micro_step, cls.optimizer_step) for cls in (DDPEngine, DeepSpeedEngine)}


def micro_step(self, inputs, is_last):
    step = current["step"]
    if step in WATCH and current["before"] is None:
        current["before"] = _tensors(self)
    model = self.unwrapped_model()
    if not hasattr(model, "_unpoisoned_forward"):
        model._unpoisoned_forward = model.forward

        def forward(*args, **kwargs):
            out = model._unpoisoned_forward(*args, **kwargs)
            kind = POISON.get(str(current["step"]))
            if kind and RANK == POISON_RANK:
                nan = torch.tensor(float("nan"), device=out.loss.device)
                out = dataclasses.replace(out, loss=out.loss + nan if kind == "add" else out.loss * nan)
            return out
        model.forward = forward
    return ORIGINAL[type(self)][0](self, inputs, is_last)


def optimizer_step(self, step_number):
    norm, skipped = ORIGINAL[type(self)][1](self, step_number)
    step = current["step"]
    if current["before"] is not None:
        after = _tensors(self)
        results.append({"step": step, "skipped": skipped,
                        **{k: _same(current["before"][k], after[k]) for k in after}})
        current["before"] = None
    current["step"] = step + 1
    return norm, skipped


def write_results():
    out = os.environ["POISON_OUT"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank_{RANK}.json"), "w") as f:
        json.dump(results, f)


for engine_class in ORIGINAL:
    engine_class.micro_step, engine_class.optimizer_step = micro_step, optimizer_step
atexit.register(write_results)

if __name__ == "__main__":
    trainer.run_guarded(trainer.main)
