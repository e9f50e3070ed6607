"""Optimizer overhead under DeepSpeed ZeRO-1/2: AdamW, our MuonAdamW, DeepSpeed's Muon, gather-everything Muon.

    python benchmarks/optimizer_overhead.py [--quick] [--world-sizes 1 2] [--stages 1 2]

Model: an action-expert-style stack (hidden 512, 8 blocks of q/k/v/o and a 4x FFN, plus a
2-layer time MLP: 50 Muon matrices, ~25M parameters); --quick uses hidden 256 and 4 blocks.
For every world size W (one set of W processes, gloo on CPU, NCCL when GPUs are present)
and ZeRO stage, it measures side by side:
- step_s: full training step (forward, backward, engine.step) of the slowest rank, the
  fastest of the timed rounds (each round runs one step of every variant in turn);
- t_ns_all: Newton-Schulz on every Muon matrix on one rank (same kernel as ours);
- efficiency = (t_variant - t_adamw) / (t_ns_all / W): 1.0 = each rank did its share of the
  Newton-Schulz work and nothing else; a design repeating it on every rank scores ~W;
- ratio = t_variant / t_adamw;
- state_bytes: optimizer state bytes on the busiest rank (DeepSpeed's Muon: its momentum
  plus its staging copy), against (4 * muon_numel + 8 * adam_numel) / W;
- extra_bytes: bytes per step this rank hands to collectives beyond AdamW's (max over ranks).
Variants: adamw (torch.optim.AdamW), muon_adamw (ours), deepspeed_muon (`"optimizer":
{"type": "Muon"}`, ns_method standard) and naive (our update, but every rank all-gathers the
whole group and orthogonalises every matrix, as OpenDM and LingBot-VLA do: MuonAdamW with
`flat_step=gather_all_step`).
Fairness settings: every variant runs eagerly (TORCHDYNAMO_DISABLE=1: DeepSpeed wraps its
Newton-Schulz in torch.compile, a C++ JIT build on CPU), DeepSpeed's Muon does its Adam
half inline (no FusedAdam JIT build), and all Newton-Schulz runs in --ns-dtype (default
float32: bf16 matmuls are ~45x slower than fp32 on CPUs without bf16 units). DeepSpeed's
own routing also sends the decoder and the modulation tables (tiny) to Muon.
Writes a table to stdout and JSON to --out.
"""
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # must precede the torch import

import argparse
import json
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from optim import MuonAdamW  # noqa: E402
from optim.config import MuonConfig  # noqa: E402
from utils.dist import free_port  # noqa: E402
from optim.newton_schulz import muon_lr, orthogonalize_stacks  # noqa: E402
from optim.routing import matrix_view, split_params  # noqa: E402
from optim.update import decay_weights  # noqa: E402

VARIANTS = ("adamw", "muon_adamw", "deepspeed_muon", "naive")
LR, WD = 1e-3, 0.01


class Block(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(hidden, elementwise_affine=False)
        self.norm2 = torch.nn.LayerNorm(hidden, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.up, self.down = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
        self.modulation = torch.nn.Parameter(torch.randn(1, 4, hidden) / hidden ** 0.5)

    def forward(self, x, t):
        shift, scale, shift2, scale2 = (self.modulation + t[:, None]).unbind(1)
        h = self.norm1(x) * (1 + scale[:, None]) + shift[:, None]
        b, n, d = h.shape
        q, k, v = (f(h).view(b, n, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        x = x + self.o(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        h = self.norm2(x) * (1 + scale2[:, None]) + shift2[:, None]
        return x + self.down(torch.nn.functional.gelu(self.up(h), approximate="tanh"))


class ActionStack(torch.nn.Module):
    """Action-expert-like: embedder, time MLP, blocks of attention + FFN with AdaLN tables, decoder."""

    def __init__(self, hidden, blocks, action_dim=14):
        super().__init__()
        torch.manual_seed(0)
        self.action_embedder = torch.nn.Linear(action_dim, hidden)
        self.time_mlp = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.SiLU(),
                                            torch.nn.Linear(hidden, hidden))
        self.blocks = torch.nn.ModuleList(Block(hidden, max(1, hidden // 64)) for _ in range(blocks))
        self.decoder = torch.nn.Linear(hidden, action_dim)

    def forward(self, actions, t_embed):
        t = self.time_mlp(t_embed)
        x = self.action_embedder(actions)
        for block in self.blocks:
            x = block(x, t)
        return self.decoder(x)


def gather_all_step(x, u, group, plan):
    """The naive design, as MuonAdamW's `flat_step`: every rank all-gathers the whole group's
    update and orthogonalises every matrix, then applies its own pieces."""
    full = torch.empty(plan.world * x.numel(), dtype=u.dtype, device=u.device)
    tdist.all_gather_into_tensor(full, u.contiguous(), group=plan.group)
    stacks = []
    for e in plan.entries:
        m = torch.empty(e.numel, dtype=u.dtype, device=u.device)
        for piece in e.pieces:
            m.narrow(0, piece.start, piece.numel).copy_(full.narrow(0, piece.rank * x.numel() + piece.offset,
                                                                    piece.numel))
        stacks.append(m.view(e.view))
    decay_weights(x, group)
    for e, o in zip(plan.entries, orthogonalize_stacks(stacks, group)):
        for piece in plan.my_pieces(e):
            x.narrow(0, piece.offset, piece.numel).add_(o.reshape(-1).narrow(0, piece.start, piece.numel),
                                                        alpha=-muon_lr(group, e.view))


class CollectiveBytes:
    """Counts the bytes this process hands to torch.distributed collectives (patched before DeepSpeed loads)."""

    # collective -> (position, keyword) of the argument holding what this rank sends
    SOURCES = {"all_reduce": (0, "tensor"), "reduce": (0, "tensor"), "broadcast": (0, "tensor"),
               "send": (0, "tensor"), "isend": (0, "tensor"), "all_gather": (1, "tensor"),
               "all_gather_into_tensor": (1, "input_tensor"), "reduce_scatter_tensor": (1, "input"),
               "all_to_all_single": (1, "input"), "reduce_scatter": (1, "input_list"),
               "all_reduce_coalesced": (0, "tensors")}

    def __init__(self):
        self.total = 0
        for name, where in self.SOURCES.items():
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), *where))

    def _wrap(self, fn, position, keyword):
        def counted(*args, **kwargs):
            src = kwargs.get(keyword, args[position] if len(args) > position else None)
            for t in src if isinstance(src, (list, tuple)) else [src]:
                if torch.is_tensor(t):
                    self.total += t.numel() * t.element_size()
            return fn(*args, **kwargs)
        return counted


def _engine(variant, stage, world, args, device):
    import deepspeed
    model = ActionStack(args.hidden, args.blocks)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
              "zero_allow_untested_optimizer": True}
    common = dict(lr=LR, weight_decay=WD, ns_dtype=args.ns_dtype, ns_method="standard", world_size=world)
    if variant == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    elif variant == "muon_adamw":
        opt = MuonAdamW(model.named_parameters(), **common)
    elif variant == "naive":
        opt = MuonAdamW(model.named_parameters(), flat_step=gather_all_step, **common)
    else:
        opt = None
        config["optimizer"] = {"type": "Muon", "params": {"lr": LR, "momentum": MuonConfig().momentum, "weight_decay": WD,
                                                          "ns_method": "standard"}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                      model_parameters=model.parameters() if opt is None else None)
    return engine, model


def _state_bytes(engine):
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    tensors = [t for s in base.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    staged = getattr(engine.optimizer, "_muon_pending_momentum", {})
    tensors += [entry[0] for entry in staged.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _batch(step, rank, args, device):
    g = torch.Generator().manual_seed(step * 1000 + rank)
    shape = (args.batch, args.tokens)
    return (torch.randn(*shape, 14, generator=g).to(device), torch.randn(args.batch, args.hidden, generator=g).to(device),
            torch.randn(*shape, 14, generator=g).to(device))


def _max_over_ranks(value, device):
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.item()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    tdist.barrier()


def _ns_all(args, device):
    """A callable that orthogonalises every Muon matrix of the model, with our kernel and settings."""
    optimizer = MuonAdamW(ActionStack(args.hidden, args.blocks).named_parameters(), ns_dtype=args.ns_dtype,
                          ns_method="standard")
    muon, group = optimizer.members("muon"), optimizer.param_groups[0]
    stacks = [torch.randn(matrix_view(p.shape), device=device) for _, p in muon]
    return lambda: orthogonalize_stacks(stacks, group), len(muon)


def _measure(stage, world, rank, args, device, counter):
    """Every variant, and t_ns_all, one step each in turn per round, so load from other
    processes on a shared machine hits all of them alike. Each time is the fastest timed
    round (the least disturbed one) of the slowest rank."""
    engines = {v: _engine(v, stage, world, args, device)[0] for v in VARIANTS}
    ns_all, n_matrices = _ns_all(args, device)
    times = {v: [] for v in VARIANTS + ("t_ns_all",)}
    sent = dict.fromkeys(VARIANTS, 0)
    for step in range(args.warmup + args.steps):
        actions, t_embed, target = _batch(step, rank, args, device)
        for variant, engine in engines.items():
            _sync(device)
            before, start = counter.total, time.perf_counter()
            engine.backward(torch.nn.functional.mse_loss(engine(actions, t_embed), target))
            engine.step()
            _sync(device)
            if step >= args.warmup:
                times[variant].append(time.perf_counter() - start)
                sent[variant] += counter.total - before
        _sync(device)
        start = time.perf_counter()
        ns_all()
        _sync(device)
        if step >= args.warmup:
            times["t_ns_all"].append(time.perf_counter() - start)
    out = {"t_ns_all": _max_over_ranks(min(times["t_ns_all"]), device), "n_matrices": n_matrices}
    for variant, engine in engines.items():
        out[variant] = dict(step_s=_max_over_ranks(min(times[variant]), device),
                            state_bytes=_max_over_ranks(_state_bytes(engine), device),
                            sent_bytes=_max_over_ranks(sent[variant] / args.steps, device))
    plans = getattr(engines["muon_adamw"].optimizer.optimizer, "plans", {})
    if "muon" in plans:
        loads = plans["muon"].loads
        out["muon_adamw"]["ns_load_balance"] = max(loads) / (sum(loads) / len(loads))
    return out


def _worker(rank, world, args, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    counter = CollectiveBytes()
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine as DeepSpeedRuntime
    from deepspeed.runtime.zero.muon import original_muon
    # no FusedAdam JIT build: DeepSpeed's Muon falls back to its inline Adam update
    DeepSpeedRuntime.get_optimizer_configuration = lambda self, *a, **k: (None, {})
    original_muon.ns_compute_dtype = lambda ns_method="gram": getattr(torch, args.ns_dtype)
    cuda = torch.cuda.is_available() and args.backend != "gloo"
    if cuda:
        torch.cuda.set_device(rank)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results = {stage: _measure(stage, world, rank, args, device, counter) for stage in args.stages}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(backend="nccl" if cuda else "gloo", results=results), f)


def _summarise(world, raw, args):
    model = ActionStack(args.hidden, args.blocks)
    muon, adam = split_params(model.named_parameters())
    muon_numel, adam_numel = sum(p.numel() for _, p in muon), sum(p.numel() for _, p in adam)
    expected_state = (4 * muon_numel + 8 * adam_numel) / world
    rows, n_matrices = [], 0
    for stage in args.stages:
        res = raw["results"][str(stage)]
        adamw, t_ns_all, n_matrices = res["adamw"], res["t_ns_all"], res["n_matrices"]
        for variant in VARIANTS:
            r = res[variant]
            row = dict(world_size=world, zero_stage=stage, variant=variant, backend=raw["backend"],
                       step_s=r["step_s"], ratio=r["step_s"] / adamw["step_s"],
                       efficiency=None if variant == "adamw" else (r["step_s"] - adamw["step_s"]) / (t_ns_all / world),
                       t_ns_all=t_ns_all, state_bytes=int(r["state_bytes"]),
                       state_vs_expected=r["state_bytes"] / expected_state,
                       sent_bytes=int(r["sent_bytes"]),
                       extra_bytes=int(max(0.0, r["sent_bytes"] - adamw["sent_bytes"])))
            if "ns_load_balance" in r:
                row["ns_load_balance"] = r["ns_load_balance"]
            rows.append(row)
    return rows, dict(muon_numel=muon_numel, adam_numel=adam_numel, muon_matrices=n_matrices)


def _table(rows):
    head = f"{'W':>2} {'ZeRO':>4} {'variant':<15} {'step s':>8} {'ratio':>6} {'effic.':>7} {'t_ns_all':>8} " \
           f"{'state MB':>9} {'vs exp.':>7} {'extra MB':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        lines.append(f"{r['world_size']:>2} {r['zero_stage']:>4} {r['variant']:<15} {r['step_s']:>8.3f} "
                     f"{r['ratio']:>6.2f} {eff:>7} {r['t_ns_all']:>8.3f} {r['state_bytes'] / 2**20:>9.2f} "
                     f"{r['state_vs_expected']:>7.3f} {r['extra_bytes'] / 2**20:>9.3f}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="hidden 256, 4 blocks, 6 timed rounds: a few minutes on 2 cores")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--hidden", type=int)
    p.add_argument("--blocks", type=int)
    p.add_argument("--tokens", type=int, default=64, help="action tokens per sample")
    p.add_argument("--batch", type=int, default=2, help="samples per rank")
    p.add_argument("--steps", type=int, help="timed rounds (one step of every variant each)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--ns-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--backend", default="auto", choices=("auto", "gloo"), help="auto: NCCL when GPUs are present")
    p.add_argument("--out", default="benchmarks/results/optimizer_overhead.json")
    args = p.parse_args()
    args.hidden = args.hidden or (256 if args.quick else 512)
    args.blocks = args.blocks or (4 if args.quick else 8)
    args.steps = args.steps or (6 if args.quick else 8)
    if torch.cuda.is_available() and args.backend == "auto" and max(args.world_sizes) > torch.cuda.device_count():
        raise SystemExit(f"--world-sizes {args.world_sizes}: only {torch.cuda.device_count()} GPUs")
    import torch.multiprocessing as mp
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows, sizes = [], {}
    for world in args.world_sizes:
        port = free_port()
        raw_path = f"{args.out}.w{world}.tmp"
        mp.spawn(_worker, args=(world, args, port, raw_path), nprocs=world)
        with open(raw_path) as f:
            raw = json.load(f)
        os.remove(raw_path)
        new_rows, sizes = _summarise(world, raw, args)
        rows += new_rows
    print(_table(rows))
    with open(args.out, "w") as f:
        json.dump(dict(command=" ".join(sys.argv), settings=vars(args), model=sizes, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
