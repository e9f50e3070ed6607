"""python -m inference.follow: a follower beside a (planted) trainer, stopped halfway and restarted,
evaluates every checkpoint once, and retention keeps the one it is evaluating; a failed rollout is
recorded and the follower goes on; the real inference.rollout evaluates a checkpoint through it, started
by scripts/slurm/evaluate.sbatch.

The trainer is checkpoint.checkpointer's real save and retention on small planted parts; the rollout is
tests/fake_follow.py's stand-in, but for the last test, which runs the real one (one short episode)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from checkpoint import checkpointer as ck
from checkpoint import evaluations as ev
from helpers import ROOT
from test_evaluations import save, saver

FAKE = os.path.join(ROOT, "tests", "fake_follow.py")
EVALUATION = {"task": "transfer_cube", "interval": 1, "episodes": 2, "seed": None, "workers": 1, "videos": 0,
              "replan": None, "episode_steps": 20, "device": "cpu", "runner": "follower"}


def run_config(run, max_steps, evaluation=EVALUATION):
    run.mkdir(parents=True, exist_ok=True)
    sections = {"training": {"max_steps": max_steps}, **({"evaluation": evaluation} if evaluation else {})}
    (run / "config.yaml").write_text(yaml.safe_dump(sections))


def start_follower(run, events, plan, *flags):
    env = {**os.environ, "FAKE_EVENTS": str(events), "FAKE_PLAN": json.dumps(plan)}
    return subprocess.Popen([sys.executable, FAKE, "follow", str(run), "--poll-seconds", "0.2", *flags], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_events(events):
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


def wait_for(condition, proc, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the follower exited ({proc.returncode}) while waiting for {what}:\n"
                                 f"{proc.stdout.read()}")
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def finish(proc, timeout=120):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def leftovers(checkpoint):
    return sorted(n for n in os.listdir(checkpoint) if ev.added_after_save(n) and n != ev.EVAL_DIR)


def test_a_follower_stopped_halfway_and_restarted_evaluates_every_checkpoint_once(tmp_path):
    run, events = tmp_path / "run", tmp_path / "events.jsonl"
    run_config(run, max_steps=3)
    trainer = saver(run)
    first, second = save(trainer, 1), save(trainer, 2)
    # the first follower: step 2's rollout runs until it is stopped
    follower = start_follower(run, events, {"1": {"seconds": 0, "success_rate": 0.5},
                                            "2": {"seconds": 600, "success_rate": 0.25}})
    wait_for(lambda: [e["event"] for e in read_events(events)] == ["start", "done", "start"], follower,
             "the evaluation of step 2")
    assert ev.is_being_evaluated(second) and not ev.is_being_evaluated(first)
    assert ev.read_best(str(run)) == first  # updated when step 1's report landed
    # the trainer saves its last checkpoint; a total_limit of 1 keeps it, the best (1) and the one evaluated (2)
    third = save(saver(run, limit=1), 3)
    assert [ck.step_of(p) for p in ck.complete_checkpoints(str(run))] == [1, 2, 3]
    follower.send_signal(signal.SIGTERM)
    code, out = finish(follower)
    assert code == 1 and "follow stopped: the running evaluation (if any) is stopped" in out, out
    assert [e["event"] for e in read_events(events)] == ["start", "done", "start", "stopped"]
    assert leftovers(second) == [] and ev.read_report(second) is None and not os.path.exists(
        os.path.join(second, ev.EVAL_DIR))  # the marker and the partial folder are gone
    assert ck.verify(second) == []
    # the second follower picks up step 2 again and step 3 (saved while none ran), then exits by itself
    follower = start_follower(run, events, {"2": {"seconds": 0, "success_rate": 0.25},
                                            "3": {"seconds": 0, "success_rate": 0.75}})
    code, out = finish(follower)
    assert code == 0, out
    done = [e["step"] for e in read_events(events) if e["event"] == "done"]
    assert done == [1, 2, 3]
    assert [ev.policy_success(ev.read_report(p)) for p in (first, second, third)] == [0.5, 0.25, 0.75]
    assert ev.read_best(str(run)) == third and (run / ev.BEST).read_text() == "checkpoint_step_3\n"
    assert all(leftovers(p) == [] and ck.verify(p) == [] for p in (first, second, third))
    assert "3 checkpoints of" in out and "have a report; best: " + third in out
    # the command the follower ran is evaluations.rollout_command's, from the run's evaluation section
    argv = read_events(events)[-1]["argv"]
    assert argv == ev.rollout_command(third, EVALUATION, "python")[3:]


def test_a_failed_rollout_is_recorded_and_the_follower_goes_on(tmp_path):
    run, events = tmp_path / "run", tmp_path / "events.jsonl"
    run_config(run, max_steps=10, evaluation=None)  # no evaluation section: the flags give it
    trainer = saver(run)
    paths = [save(trainer, s) for s in (2, 3, 4)]
    plan = {"2": {"seconds": 0, "fail": "the simulator crashed"}, "4": {"seconds": 0, "success_rate": 1.0}}
    code, out = finish(start_follower(run, events, plan, "--once", "--task", "pusht", "--episodes", "3",
                                      "--interval", "2", "--seed", "1000007", "--episode-steps", "50"))
    assert code == 1, out  # one failed
    assert [(e["event"], e["step"]) for e in read_events(events)] == [("start", 2), ("failed", 2), ("start", 4),
                                                                       ("done", 4)]  # 3 is not due (interval 2)
    assert read_events(events)[0]["argv"] == ev.rollout_command(
        paths[0], {"task": "pusht", "episodes": 3, "seed": 1000007, "episode_steps": 50}, "python")[3:]
    failure = ev.read_failure(paths[0])
    assert failure.startswith("inference.rollout exited with code 1: ") and "the simulator crashed" in failure
    assert ev.read_report(paths[0]) is None and leftovers(paths[0]) == [ev.FAILED]
    assert ev.read_best(str(run)) == paths[2] and ev.read_failure(paths[2]) is None
    # a run without an evaluation task: one message naming the file and the flag
    code, out = finish(start_follower(run, events, plan, "--once"))
    assert code == 1 and f"follow failed: {run}/config.yaml sets no evaluation.task: pass --task" in out


@pytest.mark.parametrize("flags, message", [
    (["--task", "cube", "--episodes", "2"], "evaluation.task / --task 'cube': expected one of insertion, pusht, "
                                            "transfer_cube"),
    (["--task", "pusht", "--episodes", "0"], "evaluation.episodes / --episodes must be at least 1, got 0"),
    (["--task", "pusht", "--episodes", "1", "--episode-steps", "0"],
     "evaluation.episode_steps / --episode-steps must be at least 1, got 0"),
    (["--task", "pusht", "--episodes", "1", "--poll-seconds", "0"], "--poll-seconds must be positive, got 0.0"),
])
def test_bad_settings_are_one_error_before_anything_runs(tmp_path, flags, message):
    from inference.follow import FollowError, follow, parse_args

    run_config(tmp_path, max_steps=2, evaluation=None)
    save(saver(tmp_path), 2)
    with pytest.raises(FollowError, match=re.escape(message)):
        follow(parse_args([str(tmp_path), "--once", *flags]))
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoint_step_2"))) == sorted(
        ["COMPLETE", "MANIFEST.json", "config.yaml", "trainer_state.json"])  # nothing marked or written


@pytest.fixture(scope="module")
def aloha_run(tmp_path_factory):
    """A run folder whose one checkpoint_step_4 holds an untrained 14-D export of the tiny architecture
    (tests/test_rollout.py), sealed as a checkpoint: inference.serve loads an export from there as from
    an export folder. No training: this is the follower's contract with the real rollout."""
    from test_rollout import aloha_start_pose, untrained_export

    root = tmp_path_factory.mktemp("aloha_run")
    ckpt = root / "run" / "checkpoint_step_4"
    ckpt.mkdir(parents=True)
    untrained_export(ckpt, 14, aloha_start_pose().tolist(), 0.01)
    evaluation = {**EVALUATION, "episodes": 1, "episode_steps": 10, "interval": 4}
    run_config(root / "run", max_steps=4, evaluation=evaluation)
    (ckpt / "config.yaml").write_text((root / "run" / "config.yaml").read_text())
    from checkpoint.manifest import digest_files, list_files

    ck.seal(str(ckpt), 4, digest_files(str(ckpt), list_files(str(ckpt), ck.NOT_LISTED)),
            {"weights_finite": True, "loss_finite": True}, 1)
    return root / "run"


def test_the_real_rollout_through_the_follower_as_the_slurm_job_runs_it(aloha_run):
    """scripts/slurm/evaluate.sbatch's body, run by bash as the batch script would be (no cluster needed)."""
    if not os.access(os.path.join(ROOT, ".venv", "bin", "python"), os.X_OK):
        pytest.skip("evaluate.sbatch runs .venv/bin/python, and would set it up (scripts/setup.sh) without one")
    ckpt = str(aloha_run / "checkpoint_step_4")
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "slurm", "evaluate.sbatch"), str(aloha_run)],
                         env={**os.environ, "SLURM_SUBMIT_DIR": ROOT, "SLURM_JOB_ID": "0"}, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    report = ev.read_report(ckpt)
    assert report["policy"]["checkpoint"] == ckpt and report["episodes"] == 1 and report["steps"] == 10
    assert list(report["results"]) == ["policy"]  # no baselines
    assert report["results"]["policy"]["per_episode"][0]["steps"] == 10  # the arms stay put: no success
    assert report["results"]["policy"]["success_rate"] == 0.0
    assert ev.read_best(str(aloha_run)) == ckpt and leftovers(ckpt) == [] and ck.verify(ckpt) == []
    assert f"job 0 (restart 0): following {aloha_run}" in out.stdout
    assert "  rollout | " in out.stdout  # the rollout's output is passed on
