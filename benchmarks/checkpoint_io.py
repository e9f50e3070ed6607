"""What the checkpoint manifest costs: a save with checksums against the same save without them.

    python benchmarks/checkpoint_io.py [--sizes tiny small] [--repeats 3] [--dir /tmp]
                                       [--out benchmarks/results/checkpoint_io.json]

For each model size, the files one process writes at world size 1 (the most any rank hashes) are
written through the real `Checkpointer.save` by an engine that `torch.save`s tensors of the real
sizes: the weights (fp32 for tiny, bf16 otherwise) and the ZeRO optimizer shard (fp32 master +
Adam's two moments for bf16, the two moments for fp32), with the trainable parameter count of the
size table (built on the meta device). It reports the median save time with checksums, without
them (the manifest then holds sizes only) and their ratio, and the hash throughput of the chunked,
multi-threaded SHA-256 that the manifest uses against plain sequential SHA-256 and BLAKE2b on
the weights file. The last column extrapolates the hashing time of one rank of a `motus` run on
8 GPUs (rank 0 hashes the bf16 weights and its 1/8 optimizer shard) from the measured throughput.
"""
import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint.checkpointer as ck  # noqa: E402
from checkpoint.files import DEEPSPEED_MODEL_FILE, DEEPSPEED_OPTIMIZER_FILE, ENGINE_DIR  # noqa: E402
from checkpoint.manifest import digest_files  # noqa: E402
from checkpoint.state import Registry, Shared  # noqa: E402
from recipe.config import load_config  # noqa: E402
from train.trainer_state import TrainerState  # noqa: E402

GB = 1e9


def trainable(size):
    from models.memory_model import count_components
    counts, _, _ = count_components(load_config("configs/tiny.yaml", [f"model.size={size}"]))
    return counts["video"] + counts["action_expert"] + counts["und_expert"]


def file_bytes(size, params, world=1):
    """(weights bytes, optimizer shard bytes of one rank) as the recipe saves them."""
    weights, optim = (4, 8) if size == "tiny" else (2, 12)
    return params * weights, params * optim // world


class SizedEngine:
    def __init__(self, weights, optim):
        self.tensors = {DEEPSPEED_MODEL_FILE: torch.randint(0, 255, (weights,), dtype=torch.uint8),
                        DEEPSPEED_OPTIMIZER_FILE.format(rank=0): torch.randint(0, 255, (optim,), dtype=torch.uint8)}

    def save(self, folder):
        """The checkpoint's engine part: its shards in `folder`."""
        os.makedirs(folder, exist_ok=True)
        for name, tensor in self.tensors.items():
            torch.save(tensor, os.path.join(folder, name))


def sizes_only(root, rels):
    return {rel: {"size": os.path.getsize(os.path.join(root, rel)), "sha256": ""} for rel in rels}


def time_saves(engine, folder, repeats, checksums):
    from omegaconf import OmegaConf
    from recipe.schema import Config
    times = []
    for i in range(repeats):
        run = os.path.join(folder, f"{'with' if checksums else 'without'}_{i}")
        cfg = OmegaConf.structured(Config)
        cfg.system.total_limit = None  # keep every save: each is timed
        saver = ck.Checkpointer(run, cfg)
        ck.digest_files = digest_files if checksums else sizes_only
        start = time.perf_counter()
        parts = Registry()
        parts.register(ENGINE_DIR, engine)
        parts.register("trainer_state", Shared(TrainerState(step=1)))
        saver.save(1, parts, {"weights_finite": True, "loss_finite": True})
        times.append(time.perf_counter() - start)
        shutil.rmtree(run)
    ck.digest_files = digest_files
    return statistics.median(times)


def sequential(path, name):
    h = hashlib.new(name)
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def hash_rates(path):
    """GB/s of each hash over `path` (already in the page cache from the save)."""
    size, rates = os.path.getsize(path), {}
    for name, fn in (("sha256_chunked_threads", lambda: digest_files(os.path.dirname(path), [os.path.basename(path)])),
                     ("sha256_sequential", lambda: sequential(path, "sha256")),
                     ("blake2b_sequential", lambda: sequential(path, "blake2b"))):
        start = time.perf_counter()
        fn()
        rates[name] = size / GB / (time.perf_counter() - start)
    return rates


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--out", default="benchmarks/results/checkpoint_io.json")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="checkpoint_io_", dir=args.dir)
    motus_rank0 = sum(file_bytes("motus", trainable("motus"), world=8))
    results = []
    try:
        for size in args.sizes:
            weights, optim = file_bytes(size, trainable(size))
            engine = SizedEngine(weights, optim)
            without = time_saves(engine, folder, args.repeats, checksums=False)
            with_sums = time_saves(engine, folder, args.repeats, checksums=True)
            # a save left in place, for the hash rates on its weights file
            run = os.path.join(folder, "rates")
            engine.save(os.path.join(run, ENGINE_DIR))
            rates = hash_rates(os.path.join(run, ENGINE_DIR, DEEPSPEED_MODEL_FILE))
            shutil.rmtree(run)
            results.append({"size": size, "checkpoint_gb": (weights + optim) / GB, "save_s_without_checksums": without,
                            "save_s_with_checksums": with_sums, "ratio": with_sums / without,
                            "hash_gb_per_s": rates,
                            "motus_rank0_hash_s_8_gpus": motus_rank0 / GB / rates["sha256_chunked_threads"]})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{'size':6} {'ckpt GB':>8} {'save s':>8} {'+sums s':>8} {'ratio':>6} {'chunked':>8} {'sha256':>7} "
          f"{'blake2b':>8} {'motus r0 s':>10}")
    for r in results:
        h = r["hash_gb_per_s"]
        print(f"{r['size']:6} {r['checkpoint_gb']:8.3f} {r['save_s_without_checksums']:8.2f} "
              f"{r['save_s_with_checksums']:8.2f} {r['ratio']:6.2f} {h['sha256_chunked_threads']:8.2f} "
              f"{h['sha256_sequential']:7.2f} {h['blake2b_sequential']:8.2f} {r['motus_rank0_hash_s_8_gpus']:10.1f}")
    print("(hash columns in GB/s; motus r0 s: seconds rank 0 of an 8-GPU motus run spends hashing its "
          f"{motus_rank0 / GB:.1f} GB at the chunked rate measured here)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cpu_count": os.cpu_count(), "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
