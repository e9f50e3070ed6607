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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_and_exits_for_requeue(tmp_path, sig):
    args = [sys.executable, os.path.join(ROOT, "train", "train.py"), "--config", "configs/tiny.yaml",
            "--checkpoint_dir", str(tmp_path), "--run_name", "pre", *FAST, "training.max_steps=500",
            "system.save_interval=1000", "training.optimizer=adamw"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    path = os.path.join(run_dir(tmp_path, "pre"), "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(open(path).readlines()) >= 3:
            break
        time.sleep(0.5)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    saved = complete_checkpoints(run_dir(tmp_path, "pre"))
    assert len(saved) == 1
    step = json.load(open(os.path.join(saved[0], "trainer_state.json")))["step"]
    assert metrics(tmp_path, "pre")[-1]["step"] == step >= 3
    if sig != signal.SIGUSR1:
        return  # the resume below does not depend on which signal stopped the run
    # the requeued job says `auto` and continues where the signal stopped it
    train(tmp_path, 1, "pre", ["resume.checkpoint_path=auto", f"training.max_steps={step + 2}",
                               "training.optimizer=adamw"], deepspeed=None)
    assert [r["step"] for r in metrics(tmp_path, "pre")] == list(range(1, step + 3))
