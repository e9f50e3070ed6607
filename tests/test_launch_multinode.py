"""Several nodes for real: two hosts made of network namespaces joined by a veth pair.

scripts/slurm/local_cluster.sh makes the hosts (wm-node0/1, each with its own loopback and
one interface, `wmlink`). On them: the multi-node torchrun command started by hand on each
host, then multi_node.sbatch on a two-node Slurm over the same hosts. One process per host,
gloo over the link; both must reproduce the losses of one host running two processes (same
world size, same global batch). Needs root (ip netns); the Slurm test also its packages.
"""
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import CLUSTER, FAST, ROOT, kill, losses, metrics, process_tree, run_dir, sh, the_only_cluster

pytestmark = [pytest.mark.netns, pytest.mark.distributed]

OVERRIDES = FAST + ["training.batch_size=2"]
# The environment a user puts in scripts/slurm/nccl.env for this network.
NETWORK = {"GLOO_SOCKET_IFNAME": "wmlink", "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1"}
TIMEOUT = 300


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory):
    """The environment that points local_cluster.sh at this module's state; the hosts are up."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    env = {**os.environ, "SLURM_LOCAL_DIR": str(tmp_path_factory.mktemp("cluster")), "PYTHONUNBUFFERED": "1"}
    with the_only_cluster():
        made = sh("bash", CLUSTER, "hosts", env=env, timeout=300)
        if made.returncode != 0:
            sh("bash", CLUSTER, "down", env=env)
            pytest.skip(f"cannot create the two hosts (network namespaces) here: {made.stderr[-2000:]}")
        yield env
        sh("bash", CLUSTER, "down", env=env)


def start(cmd, env):
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs):
    """Wait for all; on a timeout kill them with every worker they started."""
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            kill([pid for proc in procs for pid in process_tree(proc.pid)], signal.SIGKILL)
            pytest.fail(f"no result after {TIMEOUT} s:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs))
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-6000:]
    return outputs


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """Losses of bash scripts/train.sh with two processes on one host."""
    tmp = tmp_path_factory.mktemp("one_host")
    env = {**os.environ, "NPROC_PER_NODE": "2", "RUN_NAME": "one_host", "OMP_NUM_THREADS": "1"}
    finish([start(["bash", "scripts/train.sh", "--checkpoint_dir", str(tmp), *OVERRIDES], env)])
    return losses(metrics(tmp, "one_host"))


def check_matches(one_host, tmp, run_name):
    got = losses(metrics(tmp, run_name))
    assert sorted(got) == list(range(1, 7))
    for step in one_host:
        assert got[step] == pytest.approx(one_host[step], rel=1e-6, abs=1e-7), (step, one_host, got)
    assert os.path.exists(os.path.join(run_dir(tmp, run_name), "checkpoint_step_6", "COMPLETE"))


def test_torchrun_on_two_hosts_matches_one_host(cluster_env, one_host, tmp_path):
    """What every node of multi_node.sbatch runs, started by hand: scripts/train.sh per node rank."""
    outputs = finish([
        start(["bash", CLUSTER, "on", str(rank), "bash", "scripts/train.sh", "--checkpoint_dir", str(tmp_path),
               *OVERRIDES],
              {**cluster_env, **NETWORK, "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "wm-node0",
               "MASTER_PORT": "29500", "RUN_NAME": "two_hosts"})
        for rank in (0, 1)])
    assert all("--nnodes 2" in out and "--master_addr wm-node0 --master_port 29500" in out for out in outputs)
    check_matches(one_host, tmp_path, "two_hosts")


@pytest.mark.slurm
def test_multi_node_sbatch_matches_one_host(cluster_env, one_host, tmp_path):
    if sh("bash", CLUSTER, "install", timeout=600).returncode != 0:
        pytest.skip("Slurm packages are missing and could not be installed")
    up = sh("bash", CLUSTER, "up", "2", env=cluster_env)
    assert up.returncode == 0, up.stdout + up.stderr
    slurm = ["bash", CLUSTER, "run"]
    submitted = sh(*slurm, "sbatch", "--parsable", "--job-name=wm-launch-test-2n",
                   "scripts/slurm/multi_node.sbatch", "--checkpoint_dir", str(tmp_path), *OVERRIDES,
                   env={**cluster_env, **NETWORK, "RUN_NAME": "sbatch_two_nodes"})
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + TIMEOUT
    while sh(*slurm, "squeue", "-h", "-j", job, env=cluster_env).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} still queued after {TIMEOUT} s"
        time.sleep(0.5)
    state = sh(*slurm, "scontrol", "show", "job", job, env=cluster_env).stdout
    logs = {}
    for name in ("", "-node0", "-node1"):  # the job's log and one per node
        path = os.path.join(ROOT, "logs", f"wm-launch-test-2n-{job}{name}.out")
        with open(path) as f:
            logs[name] = f.read()
        os.remove(path)
    assert "JobState=COMPLETED" in state, logs
    assert "2 node(s), master wm-node0:" in logs[""]
    for rank in (0, 1):
        assert f"--nnodes 2 --node_rank {rank} --nproc_per_node 1 --master_addr wm-node0" in logs[f"-node{rank}"]
    check_matches(one_host, tmp_path, "sbatch_two_nodes")
