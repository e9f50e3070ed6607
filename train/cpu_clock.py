"""Training's CPU clock: CPU seconds spent on training, over every rank, carried across resumes.

A run's wall time says little on a shared machine, and `time` around `train.sh` also counts the
rollouts the trainer starts beside training (train/evaluation.py) and the start-up. This clock counts
what training itself costs, the way benchmarks/act_reference.py counts LeRobot's ACT: user + system
seconds of every thread of each rank's process from its first step on, plus its data-loader workers
(the process's children in its own session). The trainer's rollouts run in a session of their own
(utils/child.py) and are not counted; neither are start-up and loading a checkpoint. Validation and
saving happen inside the loop and are.

It is read, one small all-reduce, where the host waits anyway: when a metrics record is written
(`cpu_seconds` in metrics.jsonl) and before a save, so that each checkpoint's trainer_state.json
holds the CPU seconds up to its step (benchmarks/act_vs_recipe.py places saves on the clock with it).
"""
import contextlib
import os

import psutil

from train.trainer_state import TrainerState
from utils import dist


def _seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


class ProcessTreeClock:
    """CPU seconds of this process and of its children in its own session, as they grow.

    A child's last reading is kept after it exits (a data-loader worker restarted, a validation
    worker stopped), so the total never goes back; what it spent between that reading and its exit is
    not counted."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.session = os.getsid(0)
        self.children: dict[int, float] = {}  # pid -> seconds at its last reading

    def readings(self) -> dict[int, float]:
        """pid -> CPU seconds: this process and every child of its session seen so far."""
        for child in self.me.children(recursive=True):
            with contextlib.suppress(psutil.Error, ProcessLookupError):  # it ended between the listing and here
                if os.getsid(child.pid) == self.session:
                    self.children[child.pid] = max(self.children.get(child.pid, 0.0), _seconds(child))
        return {self.me.pid: _seconds(self.me), **self.children}

    def seconds(self) -> float:
        return sum(self.readings().values())


class CpuClock:
    """Adds every rank's CPU seconds since the last reading to `state.cpu_seconds`."""

    def __init__(self, state: TrainerState) -> None:
        self.state = state
        self.tree = ProcessTreeClock()
        self.last = self.tree.seconds()  # the loop starts here: start-up is not training

    def update(self) -> float:
        """Collective: call on every rank. The run's CPU seconds so far, the same on every rank."""
        now = self.tree.seconds()
        spent, self.last = now - self.last, now
        self.state.cpu_seconds += dist.sum_across_ranks({"cpu": spent})["cpu"]
        return self.state.cpu_seconds
