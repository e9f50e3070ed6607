"""Test launcher (torchrun starts it instead of train/train.py): the real trainer, with rank HANG_RANK
waiting forever for its batch of step HANG_STEP, as a data worker that never answers leaves it.
Kept under tests/: the product code has no hook for this."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train import train as trainer  # noqa: E402

RANK, HANG_RANK, HANG_STEP = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("HANG_RANK", 1), ("HANG_STEP", 3)))
ORIGINAL = trainer.train_step


def wait_for_a_batch_that_never_comes():
    while True:
        time.sleep(1)


def train_step(t, step):
    if RANK == HANG_RANK and step == HANG_STEP:
        wait_for_a_batch_that_never_comes()
    return ORIGINAL(t, step)


trainer.train_step = train_step

if __name__ == "__main__":
    trainer.run_guarded(trainer.main)
