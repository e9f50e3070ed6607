"""The GPU check's memory comparison, measured on the CPU: the peak bytes in use over a training step
of benchmarks/gpu_check.py's engine (the same config, model, DeepSpeed ZeRO-2 bf16 engine and
optimizer), beside the memory model's prediction. A stand-in for `torch.cuda.max_memory_allocated`
where no GPU is lent, to catch a memory-model gap before the first GPU run.

    python benchmarks/step_memory_cpu.py [--size small] [--optimizers adamw muon_adamw] [--batches 1]

How: glibc's `mallinfo2()` (bytes in use, heap + mmap) read after every aten op of the steps (a
TorchDispatchMode), minus its value before the engine is built. So: every CPU tensor the step
holds, no caching allocator, temporaries inside a single op missed. Differs from a GPU by what
differs between the devices: CPU autocast, the CPU's smaller Newton-Schulz stack cap, no cuBLAS
workspaces. Linux/glibc only. Writes benchmarks/results/step_memory_cpu.json and prints a table.
"""
import argparse
import ctypes
import gc
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import gpu_check  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


GIB = gpu_check.GIB


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        raise SystemExit("step_memory_cpu: needs glibc >= 2.33 (mallinfo2); this libc has none")
    libc.mallinfo2.restype = _MallInfo2
    return libc


LIBC = None


def bytes_in_use():
    m = LIBC.mallinfo2()
    return m.uordblks + m.hblkhd


class PeakInUse(TorchDispatchMode):
    """The most bytes in use seen after any aten op inside the block, and which op it was."""

    def __init__(self):
        super().__init__()
        self.peak, self.op = bytes_in_use(), None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        now = bytes_in_use()
        if now > self.peak:
            self.peak, self.op = now, str(func)
        return out


def measure_row(engine, model, cfg, size, batch, checkpointing, steps):
    """(peak bytes in use during `steps` steps, the op at the peak): gpu_check's peak window."""
    from models import activation_memory

    model.gradient_checkpointing = checkpointing
    inputs = activation_memory.example_inputs(cfg, model, size, batch).replace(noise_seeds=torch.arange(batch))
    gc.collect()
    with PeakInUse() as p:
        for _ in range(steps):
            out = engine(inputs)
            engine.backward(out.loss)
            engine.step()
    return p.peak, p.op


def rows_for(size_name, opt, batches, steps):
    from models.memory_model import peak, zero2_prediction

    cfg = gpu_check.check_config(size_name, opt, max(batches))
    static, per_sample, transient, _ = zero2_prediction(cfg)
    gc.collect()
    base = bytes_in_use()
    engine, model, size = gpu_check.engine_for(cfg, gpu_check.Device("cpu"))
    rows = []
    for checkpointing in (True, False):
        for batch in sorted(batches):
            used, op = measure_row(engine, model, cfg, size, batch, checkpointing, steps)
            predicted = peak(static, per_sample[checkpointing], batch, transient)
            rows.append(dict(size=size_name, optimizer=opt, batch=batch, gradient_checkpointing=checkpointing,
                             cpu_peak_gib=round((used - base) / GIB, 3), at_op=op,
                             predicted_peak_gib=round(predicted / GIB, 3),
                             measured_over_predicted=round((used - base) / predicted, 3)))
            print(json.dumps(rows[-1]), flush=True)
    del engine, model
    gc.collect()
    return rows


def main(argv=None):
    global LIBC
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small")
    p.add_argument("--optimizers", nargs="+", default=["adamw", "muon_adamw"])
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=2, help="steps in the window (the first creates the optimizer state)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "step_memory_cpu.json"))
    args = p.parse_args(argv)
    LIBC = _libc()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU measurement on a GPU host too (DeepSpeed picks its device at import)
    import deepspeed
    from utils.dist import single_process_env

    for key, value in single_process_env().items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed("gloo")
    rows = [r for opt in args.optimizers for r in rows_for(args.size, opt, args.batches, args.steps)]
    write_json(args.out, rows)
    print(f"\n{'size':<6} {'opt':<10} {'b':>2} {'ckpt':>5} {'CPU peak':>9} {'pred GiB':>9} {'meas/pred':>9}  at")
    for r in rows:
        print(f"{r['size']:<6} {r['optimizer']:<10} {r['batch']:>2} {str(r['gradient_checkpointing']):>5} "
              f"{r['cpu_peak_gib']:>9} {r['predicted_peak_gib']:>9} {r['measured_over_predicted']:>9}  {r['at_op']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
