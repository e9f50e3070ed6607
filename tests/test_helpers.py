"""The suite's own launcher: a command silent for longer than its timeout is stopped whole and says where it
stood; one that keeps printing runs on past it."""
import os
import subprocess
import sys

import pytest

from tests.helpers import Hung, run_group

SLEEPER = "import time\ndef wait_here():\n    time.sleep(600)\nwait_here()\n"


@pytest.mark.parametrize("capture", [True, False])
def test_a_hung_command_is_killed_with_its_stack_in_the_error(tmp_path, capture):
    child_pid = tmp_path / "child.pid"
    # a parent that starts a child in a session of its own and waits on it, as torchrun does its trainers
    parent = ("import os, subprocess, sys\n"
              f"child = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session=True)\n"
              f"open({str(child_pid)!r}, 'w').write(str(child.pid))\nchild.wait()\n")
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    log = open(tmp_path / "log", "wb")
    popen = dict(capture_output=True, text=True) if capture else dict(stdout=log, stderr=subprocess.STDOUT)
    with pytest.raises(Hung if capture else subprocess.TimeoutExpired) as caught:
        run_group([sys.executable, "-c", parent], 3, env=env, **popen)
    log.close()
    output = str(caught.value) if capture else (tmp_path / "log").read_text()
    assert 'line 3 in wait_here' in output, output  # the child's stack, from faulthandler
    pid = int(child_pid.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("capture", [True, False])
def test_a_command_that_keeps_printing_runs_past_the_timeout(tmp_path, capture):
    # 6 lines 0.5 s apart: 3 s in all against a guard of 2 s without output
    ticker = "import time\nfor i in range(6):\n    print(i, flush=True)\n    time.sleep(0.5)\n"
    log = open(tmp_path / "log", "wb")
    popen = dict(capture_output=True, text=True) if capture else dict(stdout=log, stderr=subprocess.STDOUT)
    result = run_group([sys.executable, "-c", ticker], 2, **popen)
    log.close()
    output = result.stdout if capture else (tmp_path / "log").read_text()
    assert result.returncode == 0 and output.split() == ["0", "1", "2", "3", "4", "5"]
