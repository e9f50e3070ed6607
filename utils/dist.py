"""Small distributed helpers that work the same on gloo (CPU) and NCCL (GPU).

A NCCL process group has no CPU backend: every tensor handed to a collective must live on
the device the group serves. `collective_device()` is the one place that decides it; the
helpers below build their tensors there.
"""
import atexit
import os
import socket
import sys
from typing import Any, Callable, Mapping, NoReturn, TypeVar

import torch
import torch.distributed as tdist

T = TypeVar("T")


def rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return tdist.get_world_size() if tdist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def free_port() -> int:
    """A TCP port that is free on this host now (for a single-host rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> dict[str, str]:
    """The rendezvous variables a launcher would set for a world of one process (a free local port)."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def is_main() -> bool:
    return rank() == 0


def collective_device(group: tdist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors the process group `group` (default: the world) can reduce: the CPU
    when it has a CPU backend (gloo, or "cpu:gloo,cuda:nccl"), else this process's current accelerator
    device: the one accelerate set (`torch.cuda.set_device(LOCAL_RANK % device_count)`), which is not
    `cuda:LOCAL_RANK` where each rank sees one GPU (one GPU per task or container: LOCAL_RANK 3, cuda:0).
    Outside a process group: the CPU, without reading any device state (safe at import and on a
    machine without an accelerator)."""
    if not tdist.is_initialized():
        return torch.device("cpu")
    backend = str(tdist.get_backend(group))
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        types = [part.split(":")[0] for part in backend.split(",")]
    else:
        types = tdist.Backend.backend_capability.get(backend, ["cpu"])
    if "cpu" in types:
        return torch.device("cpu")
    return torch.device(types[0], getattr(torch, types[0]).current_device())


def shutdown() -> None:
    """Destroy the process group before the interpreter exits (NCCL warns about one never destroyed).
    The barrier first: it releases the GIL until gloo's worker threads have freed the last collective's
    work, which they need the GIL for; destroying the group joins those threads while holding it."""
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End the trainer's process with `code` (at the end of a run, after shutdown, and on an error that
    stops it): the exit handlers run (wandb, multiprocessing's children, logging), the interpreter's
    teardown of the trainer's objects does not, because a gloo group freed there by a destructor that
    holds the GIL can wait forever on a gloo worker thread that needs the GIL."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    if tdist.is_initialized():
        tdist.barrier()


def any_rank(flag: bool | torch.Tensor, device: torch.device | str | None = None) -> bool:
    """True on every rank if `flag` is true on any rank (one tiny all-reduce; reads the result back
    to the host, so call it at start-up or at logging steps, not inside a step). `flag` may be a
    bool or a one-element tensor (e.g. a finiteness check on the GPU): a tensor is reduced as it is,
    so the one host read is of the agreed result."""
    if not tdist.is_initialized():
        return bool(flag)
    device = device or collective_device()
    t = (flag.detach().reshape(1).to(device, torch.float32) if isinstance(flag, torch.Tensor)
         else torch.tensor([1.0 if flag else 0.0], device=device))
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return bool(t.item() > 0)


def sum_across_ranks(values: Mapping[str, float | torch.Tensor],
                     device: torch.device | str | None = None) -> dict[str, float]:
    """Sum a dict of floats or 0-d tensors over ranks (every rank calls it, every rank gets the
    result as floats): one all-reduce and one read-back to the host for the whole dict."""
    return _reduce(values, device, mean=False)


def mean_across_ranks(values: Mapping[str, float | torch.Tensor],
                      device: torch.device | str | None = None) -> dict[str, float]:
    """Average a dict of floats or 0-d tensors over ranks, as `sum_across_ranks`."""
    return _reduce(values, device, mean=True)


def _reduce(values: Mapping[str, float | torch.Tensor], device: torch.device | str | None,
            mean: bool) -> dict[str, float]:
    if not values:
        return {}
    keys, device = sorted(values), device or collective_device()
    t = torch.stack([v.detach().reshape(()).to(device, torch.float64) if isinstance(v, torch.Tensor)
                     else torch.tensor(float(v), dtype=torch.float64, device=device)
                     for v in (values[k] for k in keys)])
    if tdist.is_initialized():
        tdist.all_reduce(t)
        if mean:
            t /= tdist.get_world_size()
    return dict(zip(keys, t.tolist()))


class StartupError(RuntimeError):
    """Bad input found before training starts; reported on every rank, then exit non-zero."""


def fail_together(fn: Callable[..., T], *args: Any, device: torch.device | str | None = None, **kwargs: Any) -> T:
    """Run `fn` on every rank; if it raises on any rank, raise StartupError on all of them.

    A rank that fails alone would leave the others waiting in the next collective
    until the process-group timeout; agreeing first turns that hang into an exit.
    """
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # every rank takes part in the one agreement below, failed or not
        any_rank(True, device)
        raise StartupError(str(e)) from e
    if any_rank(False, device):
        raise StartupError("another rank failed during start-up (see its message above)")
    return result


def die(message: str | BaseException, code: int = 2) -> NoReturn:
    """Print a start-up error for the person at the terminal and exit non-zero."""
    prefix = f"[rank {rank()}] " if world_size() > 1 else ""
    print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    leave(code)
