"""Collectives get tensors on the device their process group serves.

A NCCL group has no CPU backend: a CPU tensor handed to it raises. Without a GPU we run two
gloo processes that pretend to be a NCCL job: `get_backend` answers "nccl", tensors created
for `cuda:N` are CPU tensors that report `cuda:N` (a wrapper subclass), and every collective
rejects, with NCCL's own message, a tensor that is not on this rank's `cuda:LOCAL_RANK`.
The trainer's start-up agreement, preemption flag and metric averaging then run through it.
"""
import os
import time

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from utils import dist
from utils.dist import free_port


class OnGPU(torch.Tensor):
    """A CPU tensor that reports a CUDA device (the data stays in `.elem`)."""

    @staticmethod
    def __new__(cls, elem, device):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=device)
        t.elem = elem
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        device = next(x.device for x in tree_leaves(args) if isinstance(x, OnGPU))
        kwargs = {k: ("cpu" if k == "device" else v) for k, v in (kwargs or {}).items()}
        out = func(*tree_map(lambda x: x.elem if isinstance(x, OnGPU) else x, args), **kwargs)
        return tree_map(lambda x: OnGPU(x, device) if type(x) is torch.Tensor else x, out)


def _cuda_in(args, kwargs):
    for x in [*args, *kwargs.values()]:
        if isinstance(x, (str, torch.device)) and not isinstance(x, bool):
            try:
                d = torch.device(x)
            except (RuntimeError, TypeError):
                continue
            if d.type == "cuda":
                return d
    return None


class FakeCUDA(TorchFunctionMode):
    """Tensor creation and `.to()` aimed at `cuda:N` give OnGPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and isinstance(args[0], OnGPU):
            return func(args[0].elem)
        device = _cuda_in(args, kwargs)
        if device is None:
            return func(*args, **kwargs)
        cpu = lambda x: "cpu" if x is not None and _cuda_in([x], {}) is not None else x  # noqa: E731
        out = func(*[cpu(a) for a in args], **{k: cpu(v) for k, v in kwargs.items()})
        if not isinstance(out, torch.Tensor):  # torch.device(...) itself
            return func(*args, **kwargs)
        return OnGPU(out.elem if isinstance(out, OnGPU) else out, device)


def _nccl_like(real, seen):
    """A collective that only accepts tensors on this rank's GPU, as a NCCL group does."""
    def collective(tensor, *args, **kwargs):
        want = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        seen.append(tensor.device)
        if tensor.device != want:
            raise RuntimeError(f"No backend type associated with device type {tensor.device.type} "
                               f"(a NCCL group serves {want})")
        return real(tensor.elem, *args, **kwargs)
    return collective


def _worker(rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=2)
    seen = []
    real_backend = tdist.get_backend
    tdist.get_backend = lambda group=None: "nccl"
    torch.cuda.current_device = lambda: rank  # what accelerate's set_device leaves on a 2-GPU node
    tdist.all_reduce = _nccl_like(tdist.all_reduce, seen)
    try:
        from train.cpu_clock import CpuClock
        from train.record import make_record
        from train.trainer_state import TrainerState

        with FakeCUDA():
            assert dist.collective_device() == torch.device("cuda", rank)
            assert dist.any_rank(rank == 1) is True
            assert dist.any_rank(False) is False
            with pytest.raises(dist.StartupError, match="division by zero|another rank failed"):
                dist.fail_together(lambda: 1 / 0 if rank == 1 else None)
            assert dist.fail_together(lambda: rank) == rank
            loss = {"loss": torch.tensor(2.0 + rank, device=f"cuda:{rank}"),
                    "video_loss": torch.tensor(1.0 * rank, device=f"cuda:{rank}")}
            record = make_record(step=3, loss_sum=loss, grad_norm=0.5, param_groups=[{"name": "adamw"}],
                                 lrs=[1e-3], val=None, state=TrainerState(3, 12), samples_per_sec=1.0,
                                 step_time=1.0, skipped=0)
            assert record["loss"] == pytest.approx(2.5) and record["video_loss"] == pytest.approx(0.5)
            assert dist.mean_across_ranks({"a": float(rank)}) == {"a": pytest.approx(0.5)}
            assert dist.sum_across_ranks({"a": float(rank) + 1}) == {"a": 3.0}
            # the CPU clock adds every rank's seconds: rank 0 spends 0.2 s, rank 1 1.0 s, each reads the sum,
            # less the clock-tick rounding of /proc's counts (0.2 s of margin; rank 0 alone would read 0.2)
            state = TrainerState()
            clock = CpuClock(state)
            start = time.process_time()
            while time.process_time() - start < (0.2, 1.0)[rank]:
                pass
            assert clock.update() >= 1.0 and state.cpu_seconds >= 1.0
        assert seen and all(d == torch.device("cuda", rank) for d in seen), seen
    finally:
        tdist.get_backend = real_backend
        tdist.destroy_process_group()


@pytest.mark.distributed
def test_trainer_collectives_use_the_groups_device():
    """Fails on code that builds collective tensors on the CPU under NCCL."""
    mp.start_processes(_worker, args=(free_port(),), nprocs=2, join=True, start_method="spawn")


@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), ("nccl", "cuda:0"),
                                             ("cpu:gloo,cuda:nccl", "cpu"), ("cuda:nccl", "cuda:0")])
def test_collective_device_follows_the_backend(monkeypatch, backend, device):
    """One GPU per task: local rank 3 sees a single GPU, cuda:0, which accelerate made current (cuda:3 would
    be an invalid ordinal at the first collective)."""
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.collective_device() == torch.device(device)


def test_no_process_group_means_cpu():
    assert not tdist.is_initialized()
    assert dist.collective_device() == torch.device("cpu")
    assert dist.mean_across_ranks({"x": torch.tensor(3.0), "y": 1.0}) == {"x": 3.0, "y": 1.0}


def test_seeded_noise_is_standard_and_per_sample():
    """The counter-based draw (one batch of tensor ops, no per-sample generator): N(0, 1) moments and
    tails, uniform levels on [0, 1), a sample's draw independent of its batch neighbours, streams and
    seeds uncorrelated."""
    from models.flow import seeded_normal, seeded_uniform

    seeds = torch.tensor([7, 8, 2**40 + 7])
    z = seeded_normal(seeds, 2, (200, 500)).double()
    for row in z:
        assert abs(float(row.mean())) < 0.01 and abs(float(row.std()) - 1) < 0.01
        assert abs(float((row.abs() > 1.96).double().mean()) - 0.05) < 0.004  # two-sided 5% tail
    flat = z.view(3, -1)
    assert abs(float(torch.corrcoef(flat)[0, 1])) < 0.01 and abs(float(torch.corrcoef(flat)[0, 2])) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([flat[0, :-1], flat[0, 1:]]))[0, 1])) < 0.01  # neighbours
    other_stream = seeded_normal(seeds[:1], 3, (200, 500)).double().flatten()
    assert abs(float(torch.corrcoef(torch.stack([flat[0], other_stream]))[0, 1])) < 0.01
    assert torch.equal(seeded_normal(seeds[1:2], 2, (200, 500)), seeded_normal(seeds, 2, (200, 500))[1:2])
    u = seeded_uniform(seeds, 0, (100000,))
    assert float(u.min()) >= 0 and float(u.max()) < 1 and abs(float(u.double().mean()) - 0.5) < 0.005
    hist = torch.histc(u[0].double(), bins=10, min=0, max=1) / 100000
    assert float((hist - 0.1).abs().max()) < 0.005
