"""The Slurm scripts on a real one-node Slurm (Debian's packages) on the loopback address.

Submits scripts/slurm/single_node.sbatch as a user would (from the repository root, default
logs), trains the tiny recipe in 2 CPU processes, then preempts a second job with the USR1
warning that `#SBATCH --signal` sends and checks that it saves, requeues and resumes.
Needs root: scripts/slurm/local_cluster.sh installs the packages and starts the daemons.
"""
import glob
import json
import os
import subprocess
import time

import pytest

from tests.helpers import CLUSTER, FAST, ROOT, losses, metrics, run_dir, sh, the_only_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

JOB_NAME = "wm-launch-test"
# 2 processes x 2 samples; long enough that a signal sent after step 1 arrives mid-run.
OVERRIDES = [o for o in FAST if o.split("=")[0] not in ("training.max_steps", "system.save_interval")] + [
    "training.batch_size=2", "training.max_steps=8", "system.save_interval=4"]


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root to install and start Slurm (slurmctld, slurmd, munge)")
    installed = sh("bash", CLUSTER, "install", timeout=600)
    if installed.returncode != 0:
        pytest.skip(f"Slurm packages are missing and could not be installed: {installed.stderr[-2000:]}")
    state = str(tmp_path_factory.mktemp("slurm"))
    env = {**os.environ, "SLURM_LOCAL_DIR": state, "SLURM_CONF": os.path.join(state, "slurm.conf"),
           "PYTHONUNBUFFERED": "1"}
    with the_only_cluster():
        up = sh("bash", CLUSTER, "up", env=env, timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        yield env
        sh("bash", CLUSTER, "down", env=env)


def submit(env, tmp, run_name, with_launch_sh=False):
    """Submit single_node.sbatch (with sbatch, or through launch.sh) and return the job id."""
    cmd = ["bash", "scripts/slurm/launch.sh"] if with_launch_sh else \
        ["sbatch", "--parsable", "scripts/slurm/single_node.sbatch"]
    result = sh(*cmd, "--checkpoint_dir", str(tmp), *OVERRIDES,
                env={**env, "RUN_NAME": run_name, "SBATCH_JOB_NAME": JOB_NAME})
    assert result.returncode == 0, result.stdout + result.stderr
    if with_launch_sh:  # "submitted scripts/slurm/single_node.sbatch as job 7"
        return result.stdout.split(" as job ")[1].split()[0]
    return result.stdout.strip().split(";")[0]


def job_info(env, job):
    """scontrol's Key=Value fields of a job (kept MinJobAge seconds after it ends)."""
    out = sh("scontrol", "show", "job", job, env=env).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_until_gone(env, job, timeout=300):
    deadline = time.monotonic() + timeout
    while sh("squeue", "-h", "-j", job, env=env).stdout.strip():
        if time.monotonic() > deadline:
            sh("scancel", job, env=env)
            pytest.fail(f"job {job} still queued after {timeout} s:\n{read_logs(job)}")
        time.sleep(0.5)
    return job_info(env, job)


def read_logs(job):
    """The job's log and its per-node logs, removed from logs/ once read."""
    text = ""
    for path in sorted(glob.glob(os.path.join(ROOT, "logs", f"{JOB_NAME}-{job}*.out"))):
        with open(path) as f:
            text += f"==> {os.path.relpath(path, ROOT)} <==\n{f.read()}\n"
        os.remove(path)
    return text


@pytest.fixture(scope="module")
def plain_job(slurm_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    job = submit(slurm_env, tmp, "plain")
    info = wait_until_gone(slurm_env, job)
    return tmp, job, info, read_logs(job)


def test_single_node_sbatch_trains_and_checkpoints(plain_job):
    tmp, job, info, logs = plain_job
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), logs
    # the documented log files: logs/<name>-<id>.out and one per node
    assert f"==> logs/{JOB_NAME}-{job}.out <==" in logs
    assert f"==> logs/{JOB_NAME}-{job}-node0.out <==" in logs and "--nproc_per_node 2" in logs, logs
    records = metrics(tmp, "plain")
    assert [r["step"] for r in records] == list(range(1, 9)), logs
    assert all(0 < r["loss"] < 100 for r in records), records
    run = run_dir(tmp, "plain")
    for step in (4, 8):
        assert os.path.exists(os.path.join(run, f"checkpoint_step_{step}", "COMPLETE")), os.listdir(run)
    with open(os.path.join(run, "latest")) as f:
        assert f.read().strip() == "checkpoint_step_8"


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="not a git checkout")
def test_logs_directory_is_in_the_repository():
    """`#SBATCH --output=logs/...` needs logs/ to exist: without it Slurm fails the job, silently."""
    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "logs/.gitignore"], cwd=ROOT,
                             capture_output=True, text=True)
    assert tracked.returncode == 0, "logs/.gitignore must be committed so that a fresh clone has logs/"


def test_usr1_saves_requeues_and_resumes_exactly(slurm_env, plain_job, tmp_path):
    job = submit(slurm_env, tmp_path, "preempted", with_launch_sh=True)
    path = os.path.join(run_dir(tmp_path, "preempted"), "metrics.jsonl")
    # What `#SBATCH --signal=B:USR1@300` does near the time limit: USR1 to the batch shell only.
    deadline = time.monotonic() + 300
    while not (os.path.exists(path) and open(path).read().strip()):
        assert time.monotonic() < deadline, f"no training step after 300 s:\n{read_logs(job)}"
        time.sleep(0.2)
    sent = sh("scancel", "--signal=USR1", "--batch", job, env=slurm_env)
    assert sent.returncode == 0, sent.stderr
    info = wait_until_gone(slurm_env, job)
    logs = read_logs(job)

    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), logs
    saved = [line for line in logs.splitlines() if "preempted (SIGUSR1): saved step" in line]
    assert saved, f"the trainer did not save on USR1:\n{logs}"
    step = int(saved[0].split("saved step ")[1].split(",")[0])
    assert step < 8, f"the job finished before the signal arrived (saved at step {step}):\n{logs}"
    assert "(restart 1)" in logs and "resume.checkpoint_path=auto" in logs, logs
    assert f"resumed from {run_dir(tmp_path, 'preempted')}/checkpoint_step_{step} at step {step}" in logs, logs

    records = [json.loads(line) for line in open(path)]
    assert [r["step"] for r in records] == list(range(1, 9)), logs
    # Save, requeue and resume through the launcher change nothing: the uninterrupted job's losses.
    assert losses(records) == losses(metrics(plain_job[0], "plain"))
