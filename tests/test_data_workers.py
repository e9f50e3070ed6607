"""DataLoader workers live through a scheduler's SIGTERM / SIGUSR1 and still end when their loader does."""
import os
import subprocess
import sys
import textwrap

from tests.helpers import ROOT

_LOADER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    import torch
    from data.worker_signals import worker_init_fn, workers_started_blocked

    class Numbers(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            time.sleep(0.01)
            return torch.tensor([i, os.getpid()])

    fixed = sys.argv[1] == "fixed"
    loader = torch.utils.data.DataLoader(Numbers(), batch_size=2, num_workers=2,
                                         worker_init_fn=worker_init_fn if fixed else None)
    with workers_started_blocked() if fixed else open(os.devnull):
        batches = iter(loader)
    first = next(batches)
    workers = sorted(int(p) for p in open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split())
    for sig in sys.argv[2:]:  # sent by another process, as a scheduler does
        for pid in workers:
            subprocess.run(["kill", "-" + sig, str(pid)], check=True)
    time.sleep(0.5)
    print([int(n) for b in [first, *batches] for n in b[:, 0]] == list(range(64)), flush=True)
    batches = iter(loader)
    next(batches)
    raise SystemExit(3)  # leaving with live workers: multiprocessing terminates and joins them at exit
""")


def _run(*args):
    return subprocess.run([sys.executable, "-c", _LOADER, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": ROOT})


def test_workers_signalled_by_another_process_keep_loading_every_batch_in_order():
    done = _run("fixed", "TERM", "USR1")
    assert done.stdout.strip() == "True", done.stderr[-2000:]
    assert done.returncode == 3, done.stderr[-2000:]


def test_without_the_init_fn_a_sigterm_kills_the_worker():
    """The control: torch's own worker dies of a SIGTERM that did not come from its parent."""
    done = _run("plain", "TERM")
    assert "is killed by signal: Terminated" in done.stderr, done.stderr[-2000:]
    assert done.returncode == 1
