"""Run train/train.py as users do (torchrun, several processes) and read what it wrote."""
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from utils.dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
# Small and quick: the tiny recipe at 4 samples per step, no validation unless asked.
FAST = ["training.max_steps=6", "system.save_interval=3", "system.val_interval=1000", "system.num_workers=0",
        "logging.report_to=none", "training.warmup_steps=2"]


def torchrun(nproc, args, timeout=420, env=None, log_file=None, script=os.path.join(ROOT, "train", "train.py")):
    """`log_file`: stdout and stderr go to that file byte for byte, as a SLURM job's log (its text,
    carriage returns kept, comes back as the result's stdout). `script`: what torchrun starts.
    `timeout`: seconds without output before the launch counts as hung (run_group)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), script, *args]
    # PYTHONFAULTHANDLER: on a timeout run_group's SIGABRT makes every process print where it stands
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
                **(env or {})}
    if log_file is None:
        return run_group(cmd, timeout, capture_output=True, text=True, env=full_env)
    try:
        with open(log_file, "wb") as f:
            result = run_group(cmd, timeout, stdout=f, stderr=subprocess.STDOUT, env=full_env)
    except subprocess.TimeoutExpired as timeout_error:
        with open(log_file, errors="replace") as f:
            raise Hung(timeout_error, f.read()) from None
    with open(log_file, newline="") as f:
        result.stdout, result.stderr = f.read(), ""
    return result


class Hung(AssertionError):
    """A command past its timeout, with the end of what it printed: the stacks each Python process
    dumped on SIGABRT (PYTHONFAULTHANDLER) say where it stood."""

    def __init__(self, error: subprocess.TimeoutExpired, output: str):
        super().__init__(f"{error}\n--- the end of its output ---\n{output[-12000:]}")


def run_group(cmd, timeout, capture_output=False, **popen):
    """subprocess.run that kills the command with every process it started when it has printed nothing
    for `timeout` seconds, or on an interrupt (torchrun starts each trainer in a session of its own, so
    a process group is not enough; trainers left running hold the cores the next test needs).

    The guard is on progress, not on time: a launch on a loaded machine goes on as long as it keeps
    printing (the trainer logs its start-up and steps, the VAE fit every 50 steps), while a trainer
    stuck in a collective falls silent. Output is watched through the files it goes to: temporary
    files for `capture_output`, the file given as `stdout` otherwise."""
    with contextlib.ExitStack() as stack:
        if capture_output:
            popen.update(stdout=stack.enter_context(tempfile.TemporaryFile()),
                         stderr=stack.enter_context(tempfile.TemporaryFile()))
        watched = [f for f in (popen.get("stdout"), popen.get("stderr")) if hasattr(f, "fileno")]
        text = popen.pop("text", False)
        with subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, **popen) as proc:
            try:
                wait_while_printing(proc, watched, timeout)
            except subprocess.TimeoutExpired as error:
                stop_tree(proc)
                if capture_output:
                    raise Hung(error, "\n".join(read_back(f, text) for f in watched)) from None
                raise
            except BaseException:
                kill(process_tree(proc.pid), signal.SIGKILL)
                proc.wait()
                raise
        stdout, stderr = (read_back(f, text) for f in watched) if capture_output else (None, None)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def wait_while_printing(proc, files, quiet):
    """Wait for `proc`; subprocess.TimeoutExpired once `files` (its output) have not grown for `quiet`
    seconds."""
    size, last_growth = -1, time.monotonic()
    while True:
        try:
            proc.wait(timeout=1)
            return
        except subprocess.TimeoutExpired:
            now_size = sum(os.fstat(f.fileno()).st_size for f in files)
            if now_size != size:
                size, last_growth = now_size, time.monotonic()
            elif time.monotonic() - last_growth > quiet:
                raise subprocess.TimeoutExpired(proc.args, quiet) from None


def read_back(f, text):
    """What a command wrote to `f`; with `text`, decoded with universal newlines, as subprocess.run's text=True."""
    f.seek(0)
    data = f.read()
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n") if text else data


def process_tree(pid):
    """pid and all its descendants, parents first."""
    children = {}
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat") as f:  # "pid (comm) state ppid ...": comm may hold spaces
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
    tree = [pid]
    for parent in tree:
        tree.extend(children.get(parent, []))
    return tree


def kill(pids, sig):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_tree(proc):
    """SIGABRT to the command's descendants first, so that Python processes started with
    PYTHONFAULTHANDLER print their stacks (a trainer stuck in a collective says which), then SIGKILL
    to all of them."""
    tree = process_tree(proc.pid)
    kill(tree[1:] or tree, signal.SIGABRT)
    time.sleep(3)
    kill(tree, signal.SIGKILL)
    proc.wait()


PREPARED = set()  # the configs whose generated inputs this test process has made


def prepare_generated(config, timeout=1800):
    """Make a recipe's generated inputs (the synthetic data, the tiny frozen parts with the VAE fitted
    to it), as a launch makes them at start-up, once per config and test process, before the launch's
    own guard starts. Waiting on the fit's lock while the other test worker fits it (a minute on 2 free
    cores, longer on a loaded machine) prints nothing and could outlast a launch's guard though nothing
    hangs: the guard of a launch is then about its training, and this build has its own, longer one."""
    if config in PREPARED:
        return
    code = ("import sys; sys.path.insert(0, {root!r}); from recipe.config import load_config; "
            "from recipe.generated import ensure_generated_inputs; "
            "ensure_generated_inputs(load_config({config!r}, {fast!r}))").format(root=ROOT, config=config, fast=FAST)
    result = run_group([PYTHON, "-c", code], timeout, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-6000:]
    PREPARED.add(config)


def train(tmp, nproc, run_name, overrides=(), deepspeed="configs/zero2.json", config="configs/tiny.yaml",
          check=True, timeout=420, **launch):
    """`launch`: torchrun's log_file / script. The config's generated inputs are made first
    (prepare_generated), outside `timeout`."""
    prepare_generated(config)
    args = ["--config", config, "--checkpoint_dir", str(tmp), "--run_name", run_name]
    if deepspeed:
        args += ["--deepspeed", deepspeed]
    result = torchrun(nproc, args + list(FAST) + list(overrides), timeout=timeout, **launch)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def run_dir(tmp, run_name, config="tiny"):
    return os.path.join(str(tmp), config, run_name)


def metrics(tmp, run_name, config="tiny"):
    with open(os.path.join(run_dir(tmp, run_name, config), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(records):
    return {r["step"]: r["loss"] for r in records}


# The tiny architecture at 64x64, 4-D actions, on its own tiny frozen parts under `{d}` (built on first
# use): the model-level tests' recipe. conftest's `tiny_yaml` writes it once a session.
TINY_YAML = """
common: {{action_dim: 4, state_dim: 4, num_video_frames: 4, video_height: 64, video_width: 64,
         global_downsample_rate: 2, video_action_freq_ratio: 2}}
model:
  size: tiny
  wan: {{vae_path: {d}/vae, text_encoder_path: {d}/text_encoder}}
  vlm: {{checkpoint_path: {d}/vlm}}
  und_expert: {{vlm: {{input_dim: 32}}}}
"""


def config_from(tmp_path, sections):
    """Write `sections` as a YAML file in tmp_path and load it through the real schema."""
    import yaml

    from recipe.config import load_config
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(sections))
    return load_config(str(path))


CLUSTER = os.path.join(ROOT, "scripts", "slurm", "local_cluster.sh")


@contextlib.contextmanager
def the_only_cluster():
    """Held while a test module's local Slurm cluster or network-namespace hosts are up: they use fixed
    names (wm-node0/1, munge's socket, job ids in logs/), so the test workers take turns."""
    with open(os.path.join(tempfile.gettempdir(), "wm-local-cluster.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def sh(*cmd, env=None, timeout=120):
    """Run a command from the repository root and capture its output."""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def wait_while_progressing(procs, logs, stall_seconds=240):
    """Wait for `procs`; kill them all when one fails (its peers would wait for it forever) or when
    none of their `logs` has grown for `stall_seconds`: a hang guard, not a time limit, so a busy
    machine slows the test down without failing it."""
    def size():
        return sum(os.path.getsize(p) for p in logs if os.path.exists(p))

    last, last_change = size(), time.monotonic()
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        now = size()
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > stall_seconds:
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
