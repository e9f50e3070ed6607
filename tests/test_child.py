"""utils/child.py: a child in its own session still ends when its parent is killed outright, and the
trainer's rollout is started that way."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

# a child that writes 'stopped' when SIGINT reaches it, as the rollout stops its server and workers
CHILD = ("import os, sys, time\ntry:\n    open(sys.argv[1] + '.tmp', 'w').close()\n"
         "    os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n    time.sleep(600)\n"
         "except KeyboardInterrupt:\n    open(sys.argv[2], 'w').write('stopped')\n")


def start_parent(tmp_path, how: str, background: bool = False) -> tuple[subprocess.Popen, psutil.Process]:
    """A parent (as the trainer's rank 0) that starts CHILD `how` and then waits; returns it and the child.
    `background`: the parent ignores SIGINT, as a shell's background job (`nohup ... &`, CI) does."""
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    starts = {
        "bound": "from utils.child import bound_to_parent\n"
                 "child = bound_to_parent(cmd, signal.SIGINT)\n",
        "rollout": "from train.evaluation import Rollout\n"
                   f"child = Rollout({str(tmp_path)!r}, cmd, {str(tmp_path / 'log')!r}).proc\n",
        "plain": "child = subprocess.Popen(cmd, start_new_session=True)\n",
    }
    parent = ("import signal, subprocess, sys, time\n"
              f"cmd = [sys.executable, '-c', {CHILD!r}, {str(ready)!r}, {str(stopped)!r}]\n" + starts[how] +
              "print(child.pid, flush=True)\ntime.sleep(600)\n")
    sigint = signal.SIG_IGN if background else signal.SIG_DFL
    proc = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    assert proc.stdout is not None
    child = psutil.Process(int(proc.stdout.readline()))
    for _ in range(600):  # a hang guard: the child is ready within seconds
        if ready.exists() or not child.is_running():
            break
        time.sleep(0.1)
    assert ready.exists(), "the child never started"
    assert os.getsid(child.pid) == child.pid  # a session of its own
    return proc, child


@pytest.mark.parametrize("how", ["bound", "rollout"])
@pytest.mark.parametrize("background", [False, True])
def test_a_child_gets_its_signal_when_the_parent_is_killed(tmp_path, how, background):
    proc, child = start_parent(tmp_path, how, background)
    proc.kill()  # SIGKILL: no handler, no atexit runs in the parent
    proc.wait()
    _, alive = psutil.wait_procs([child], timeout=60)  # a hang guard: it goes within a second
    for p in alive:
        p.kill()
    assert alive == [], f"the child of a killed parent is still running ({how})"
    assert (tmp_path / "stopped").read_text() == "stopped"  # by SIGINT, which it handles: a clean stop
    if how == "rollout":
        assert (tmp_path / "log").read_text().startswith("$ ")  # Rollout's own log, the command first


def test_without_it_the_child_outlives_its_parent(tmp_path):
    """The control: what a plain Popen in a new session does when the parent is killed."""
    proc, child = start_parent(tmp_path, "plain")
    proc.kill()
    proc.wait()
    try:
        _, alive = psutil.wait_procs([child], timeout=2)
        assert alive == [child]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
