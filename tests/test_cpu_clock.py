"""train/cpu_clock.py: training's CPU seconds count the trainer's process and its data-loader workers
(children in its session), not the rollouts it starts in a session of their own, never go back when a
worker exits, and carry on from a checkpoint's count."""
import subprocess
import sys
import time

from train.cpu_clock import CpuClock, ProcessTreeClock
from train.trainer_state import TrainerState

# Spends `argv[1]` CPU seconds, says so, then waits for stdin to close.
BURN = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < float(sys.argv[1]):\n    pass\n"
        "print('spent', flush=True)\nsys.stdin.read()")


def burner(seconds: float, new_session: bool) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", BURN, str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, start_new_session=new_session)
    assert child.stdout is not None and child.stdout.readline() == "spent\n"
    return child


def test_the_session_s_children_count_and_a_rollout_s_do_not():
    clock = ProcessTreeClock()
    worker, rollout = burner(0.5, new_session=False), burner(0.5, new_session=True)
    try:
        readings = clock.readings()
        assert readings[worker.pid] >= 0.45  # the child's own clock said 0.5 s; /proc counts in clock ticks
        assert rollout.pid not in readings
        before = clock.seconds()
    finally:
        for child in (worker, rollout):
            child.communicate("")
    # the exited worker keeps its last reading: the total never goes back
    assert clock.readings()[worker.pid] >= 0.45 and clock.seconds() >= before


def test_update_adds_the_seconds_spent_since_the_last_reading():
    state = TrainerState(step=3000, cpu_seconds=100.0)  # as restored from a checkpoint
    clock = CpuClock(state)
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    first = clock.update()
    # /proc counts in clock ticks: 0.05 s of margin below; 5 s above, far more than this test's overhead
    assert first == state.cpu_seconds and 100.25 <= first < 100.3 + 5
    assert clock.update() >= first


def test_a_checkpoint_from_before_the_clock_counts_from_its_step():
    state = TrainerState()
    state.load_state_dict({"step": 3600, "samples_seen": 57600, "skipped_nonfinite_steps": 0})
    assert (state.cpu_seconds, state.cpu_seconds_since_step) == (0.0, 3600)
    saved = TrainerState(4000, 64000, 0, 1234.5, 0).state_dict()
    state.load_state_dict(saved)
    assert (state.cpu_seconds, state.cpu_seconds_since_step) == (1234.5, 0)
