"""`python -m optim.plan CONFIG --world-sizes 8 64 512 [--tflops 989] [key=value ...]`: what Muon
costs at cluster scale, predicted from the model's shapes (built on the meta device: no weights,
no GPU) with MuonAdamW's own order and ZeRO's partition layout (optim/ownership.py).

Per world size W (what each column means: docs/optimizer.md, "The Muon plan at cluster scale"):
- Newton-Schulz flops per rank, max and mean, and the floor: the flops of the most expensive
  tensor, which has one owner however many ranks there are; ranks that own no tensor;
- the predicted Newton-Schulz time of the busiest rank, max flops / (tflops * mfu);
- the bytes Muon moves beyond ZeRO's own traffic: straddler pieces sent to their owner and
  the results sent back, in the Newton-Schulz dtype (busiest rank, and the sum over ranks);
- both as a fraction of a predicted ZeRO-2 step (see `zero2_step`).
It prints a table and writes JSON (--out).
"""
import argparse
import json
import os
from typing import Any, Iterable, Sequence

import torch
from omegaconf import DictConfig

from optim.build import muon_arguments
from optim.config import MuonConfig
from optim.muon_adamw import MuonAdamW
from optim.newton_schulz import DTYPES, matrix_cost
from optim.ownership import assign_owners, predicted_pieces
from optim.routing import matrix_view


def muon_plan(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], muon_cfg: DictConfig | MuonConfig,
              world_size: int) -> dict[str, Any]:
    """Newton-Schulz flops per rank and Muon's extra elements per rank at `world_size` ranks,
    for the Muon groups of MuonAdamW(named_parameters, **training.muon, world_size=W)."""
    optimizer = MuonAdamW(named_parameters, world_size=world_size, **muon_arguments(muon_cfg))
    loads, sent = [0] * world_size, [0] * world_size  # flops; bytes sent per rank
    tensors = matrices = floor = 0
    for group in optimizer.param_groups:
        if not group["muon"]:
            continue
        members = optimizer.members(group["name"])
        costs = [matrix_cost(p.shape, group["ns_steps"]) for _, p in members]
        pieces = predicted_pieces([p.numel() for _, p in members], world_size)
        owners, group_loads = assign_owners(pieces, costs, world_size)
        loads = [a + b for a, b in zip(loads, group_loads)]
        itemsize = DTYPES[group["ns_dtype"]].itemsize
        for own, owner in zip(pieces, owners):
            for piece in own:
                if piece.rank != owner:  # gathered to the owner, and its result returned
                    sent[piece.rank] += piece.numel * itemsize
                    sent[owner] += piece.numel * itemsize
        tensors += len(members)
        matrices += sum(matrix_view(p.shape)[0] for _, p in members)
        floor = max([floor] + costs)
    return dict(world_size=world_size, tensors=tensors, matrices=matrices, ns_flops_total=sum(loads),
                ns_flops_max=max(loads), ns_flops_mean=sum(loads) / world_size, ns_flops_floor=floor,
                ranks_without_tensor=sum(load == 0 for load in loads),
                extra_bytes_max=max(sent), extra_bytes_total=sum(sent), ns_flops_per_rank=loads,
                extra_bytes_per_rank=sent)


def zero2_step(flops_per_rank: float, trainable: int, world_size: int, grad_bytes: int, accumulation: int,
               peak_flops: float, bandwidth: float) -> tuple[float, float]:
    """The step model: compute (forward + backward flops of every micro-batch, at `peak_flops`
    already scaled by the MFU) plus ZeRO-2's communication, not overlapped: a ring
    reduce-scatter of the gradients per micro-batch and one all-gather of the updated weights,
    each (W - 1) / W * trainable * grad_bytes per rank, at `bandwidth` bytes/s per rank.
    Returns seconds (compute, communication)."""
    comm = (accumulation + 1) * (world_size - 1) / world_size * trainable * grad_bytes
    return flops_per_rank / peak_flops, comm / bandwidth


def plan_rows(cfg: DictConfig, named: list[tuple[str, torch.nn.Parameter]], tokens: dict[str, int], flops_per_sample: float,
              world_sizes: Sequence[int], tflops: float, mfu: float,
              bandwidth_gbs: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per world size: the Muon plan against the predicted ZeRO-2 step (see module docstring).
    `named`: the model's named parameters; `tokens`: tokens per sample of each expert; `flops_per_sample`:
    forward + backward flops of one sample (models/activation_memory.py counts both)."""
    trainable = sum(p.numel() for _, p in named if p.requires_grad)
    peak = tflops * 1e12 * mfu
    grad_bytes = 2 if cfg.model.precision == "bf16_mixed" else 4
    rows = []
    for world in world_sizes:
        row = muon_plan(named, cfg.training.muon, world)
        accumulation = cfg.training.gradient_accumulation_steps
        compute, comm = zero2_step(flops_per_sample * cfg.training.batch_size * accumulation, trainable, world,
                                   grad_bytes, accumulation, peak, bandwidth_gbs * 1e9)
        bandwidth = bandwidth_gbs * 1e9
        row.update(ns_time_s=row["ns_flops_max"] / peak, extra_time_s=row["extra_bytes_max"] / bandwidth,
                   step_compute_s=compute, step_comm_s=comm, zero2_bytes_per_rank=comm * bandwidth)
        row.update(ns_fraction=row["ns_time_s"] / (compute + comm),
                   extra_fraction=row["extra_time_s"] / (compute + comm))
        rows.append(row)
    assumptions = dict(trainable=trainable, tokens_per_sample=tokens, batch_size=cfg.training.batch_size,
                       gradient_accumulation_steps=cfg.training.gradient_accumulation_steps,
                       flops_per_sample=flops_per_sample, tflops=tflops, mfu=mfu, bandwidth_gbs=bandwidth_gbs,
                       grad_bytes=grad_bytes,
                       step="6 * sum(expert params * its tokens) * batch * accumulation at tflops * mfu, plus "
                            "(accumulation + 1) * (W-1)/W * trainable * grad_bytes per rank at bandwidth, "
                            "not overlapped")
    return rows, assumptions


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'W':>5} {'tensors':>7} {'NS max GF':>10} {'max/mean':>8} {'floor GF':>9} {'idle':>5} "
            f"{'NS ms':>8} {'extra MB':>9} {'step ms':>9} {'NS/step':>8} {'extra/step':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        step = r["step_compute_s"] + r["step_comm_s"]
        lines.append(f"{r['world_size']:>5} {r['tensors']:>7} {r['ns_flops_max'] / 1e9:>10,.1f} "
                     f"{r['ns_flops_max'] / r['ns_flops_mean']:>8.2f} {r['ns_flops_floor'] / 1e9:>9,.1f} "
                     f"{r['ranks_without_tensor']:>5} {r['ns_time_s'] * 1e3:>8.2f} "
                     f"{r['extra_bytes_max'] / 2**20:>9.2f} {step * 1e3:>9.1f} {r['ns_fraction']:>8.2%} "
                     f"{r['extra_fraction']:>10.2%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H100/H200 SXM: 989)")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of the peak reached, by the step and by "
                        "Newton-Schulz alike")
    parser.add_argument("--bandwidth-gbs", type=float, default=50.0,
                        help="GB/s per GPU for collectives (50: one 400 Gb/s NIC per GPU across nodes)")
    parser.add_argument("--und-tokens", type=int, default=None,
                        help="understanding (VLM feature) tokens per sample; default: one frame's image tokens "
                             "plus a 40-token prompt, as models/activation_memory.py counts them")
    parser.add_argument("--out", default="benchmarks/results/muon_plan.json")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_intermixed_args()
    if min(args.world_sizes) < 1 or args.tflops <= 0 or not 0 < args.mfu <= 1 or args.bandwidth_gbs <= 0:
        parser.error("--world-sizes must be >= 1, --tflops and --bandwidth-gbs > 0, --mfu in (0, 1]")
    # a program, not library code: it reads the recipe and builds the model it plans for
    from models.activation_memory import expert_tokens, model_flops_per_sample
    from models.build import size_table_model
    from models.sizes import get_size
    from recipe.config import load_config

    cfg = load_config(args.config, args.overrides)
    with torch.device("meta"):  # the trainable WorldModel from the size table (as models/memory_model.py)
        model = size_table_model(cfg)
    tokens = expert_tokens(cfg, model, get_size(cfg.model.size))  # the memory model's real shapes
    if args.und_tokens is not None:
        tokens["und"] = args.und_tokens
    rows, assumptions = plan_rows(cfg, list(model.named_parameters()), tokens, model_flops_per_sample(model, tokens),
                                  args.world_sizes, args.tflops, args.mfu, args.bandwidth_gbs)
    print(f"{args.config}: {rows[0]['tensors']} Muon tensors ({rows[0]['matrices']} matrices), "
          f"{rows[0]['ns_flops_total'] / 1e12:.2f} TFLOP of Newton-Schulz per step; "
          f"{assumptions['trainable']:,} trainable parameters, tokens per sample "
          f"{assumptions['tokens_per_sample']}, batch {cfg.training.batch_size}")
    print(f"step model: {assumptions['step']}; {args.tflops:g} TFLOPS x MFU {args.mfu:g}, {args.bandwidth_gbs:g} GB/s")
    print(table(rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(config=args.config, assumptions=assumptions, rows=rows), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
