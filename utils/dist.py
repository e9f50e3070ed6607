"""Small distributed helpers that work the same on gloo (CPU) and NCCL (GPU)."""
import os
import socket
import sys

import torch
import torch.distributed as dist


def rank():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size():
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def free_port():
    """A TCP port that is free on this host now (for a single-host rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_main():
    return rank() == 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def any_rank(flag, device="cpu"):
    """True on every rank if `flag` is true on any rank (one tiny all-reduce)."""
    if not dist.is_initialized():
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def mean_across_ranks(values, device="cpu"):
    """Average a dict of floats over ranks (every rank calls it, every rank gets the result)."""
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


class StartupError(RuntimeError):
    """Bad input found before training starts; reported on every rank, then exit non-zero."""


def fail_together(fn, *args, device="cpu", **kwargs):
    """Run `fn` on every rank; if it raises on any rank, raise StartupError on all of them.

    A rank that fails alone would leave the others waiting in the next collective
    until the process-group timeout; agreeing first turns that hang into an exit.
    """
    error = None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # reported below, on every rank
        error, result = e, None
    if any_rank(error is not None, device):
        if error is None:
            raise StartupError("another rank failed during start-up (see its message above)")
        raise StartupError(str(error)) from error
    return result


def die(message, code=2):
    """Print a start-up error for the person at the terminal and exit non-zero."""
    prefix = f"[rank {rank()}] " if world_size() > 1 else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)
