"""SIGTERM / SIGUSR1: the trainer finishes the step, saves, exits 75; `auto` resume continues."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import FAST, ROOT, metrics, run_dir, train
from train.preemption import REQUEUE_EXIT_CODE
from checkpoint.checkpointer import complete_checkpoints

pytestmark = pytest.mark.distributed


def _start(tmp_path, overrides=(), **popen):
    args = [sys.executable, os.path.join(ROOT, "train", "train.py"), "--config", "configs/tiny.yaml",
            "--checkpoint_dir", str(tmp_path), "--run_name", "pre", *FAST, "training.max_steps=500",
            "system.save_interval=1000", "training.optimizer=adamw", *overrides]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, **popen)
    path = os.path.join(run_dir(tmp_path, "pre"), "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(open(path).readlines()) >= 3:
            break
        time.sleep(0.5)
    return proc


def _saved_step(proc, tmp_path):
    """The step of the one checkpoint the signal's save wrote; the run exited for requeue."""
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    saved = complete_checkpoints(run_dir(tmp_path, "pre"))
    assert len(saved) == 1
    step = json.load(open(os.path.join(saved[0], "trainer_state.json")))["step"]
    assert metrics(tmp_path, "pre")[-1]["step"] == step >= 3
    return step


def test_a_sigterm_to_every_process_of_the_job_still_saves(tmp_path):
    """Slurm's preemption, scancel and pkill signal the DataLoader workers as well: they must not die of
    it (torch's worker does) before the rank has acted on the same signal. (SIGUSR1: the workers inherit
    the rank's handler; tests/test_data_workers.py covers a worker without it.)"""
    proc = _start(tmp_path, ["system.num_workers=2"], start_new_session=True)
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        workers = f.read().split()
    assert len(workers) == 2, workers
    os.killpg(proc.pid, signal.SIGTERM)
    _saved_step(proc, tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_and_exits_for_requeue(tmp_path, sig):
    proc = _start(tmp_path)
    proc.send_signal(sig)
    step = _saved_step(proc, tmp_path)
    if sig != signal.SIGUSR1:
        return  # the resume below does not depend on which signal stopped the run
    # the requeued job says `auto` and continues where the signal stopped it
    train(tmp_path, 1, "pre", ["resume.checkpoint_path=auto", f"training.max_steps={step + 2}",
                               "training.optimizer=adamw"], deepspeed=None)
    assert [r["step"] for r in metrics(tmp_path, "pre")] == list(range(1, step + 3))
