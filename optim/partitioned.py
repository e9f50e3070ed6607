"""Muon on DeepSpeed's flat fp32 partitions: owner-centric Newton-Schulz (DESIGN.md section 5).

Under ZeRO-1/2 (and DeepSpeed's bf16 optimizer) a Muon group's step() sees one flat fp32
partition `x` with its flat gradient; the model tensors are cut across ranks. Each model
tensor that has a piece on this rank carries DeepSpeed's `_hp_mapping`: the piece's start
in the tensor (`lp_fragment_address`) and in the partition (`hp_fragment_address`). The
plan is built once from these addresses, gathered from every rank:
- momentum lives in the flat layout (state key "momentum_buffer", same shape as `x`), so
  the momentum and Nesterov update are elementwise over the partition;
- `assign_owners` gives each tensor one owner; tensors wholly inside this partition are
  orthogonalised in place, straddlers are gathered to their owner in one all-to-all
  (started asynchronously, overlapped with the local Newton-Schulz), orthogonalised, and
  the owner returns every other rank's piece of the result in a second all-to-all.
Pieces travel in the Newton-Schulz dtype, which is also the first cast the algorithm makes.
"""
import torch
import torch.distributed as dist

from optim.newton_schulz import DTYPES, muon_lr, ns_flops, orthogonalize_stacks
from optim.ownership import assign_owners
from optim.routing import matrix_view


class _Entry:
    """One Muon tensor of the group: its matrix view, pieces per rank and owner."""

    def __init__(self, name, shape, pieces):
        self.name, self.view = name, matrix_view(shape)
        self.numel = self.view[0] * self.view[1] * self.view[2]
        self.pieces = pieces  # [(rank, start in tensor, numel, start in that rank's partition)]
        self.owner = None


class FlatMuonPlan:
    """Who owns what, and the all-to-all layouts, for one flat Muon group on this rank."""

    def __init__(self, members, flat, ns_steps):
        self.partition_numel = flat.numel()
        if not any(hasattr(p, "_hp_mapping") for _, p in members):
            raise RuntimeError("MuonAdamW: a param group holds one flat tensor but the model's parameters carry "
                               "no DeepSpeed _hp_mapping; only ZeRO-1/2 partitions are supported in flat form")
        table = self._gather_fragments(members, flat)
        self.entries = []
        for k, (name, p) in enumerate(members):
            pieces = [(r, *table[r][k]) for r in range(self.world) if table[r][k][1] > 0]
            entry = _Entry(name, p.shape, pieces)
            if sum(piece[2] for piece in pieces) != entry.numel:
                raise RuntimeError(f"MuonAdamW: the ZeRO pieces of '{name}' cover {sum(pc[2] for pc in pieces)} "
                                   f"of its {entry.numel} elements; was the optimizer built from the model that "
                                   "was given to deepspeed.initialize?")
            self.entries.append(entry)
        costs = [e.view[0] * ns_flops(e.view[1], e.view[2], ns_steps) for e in self.entries]
        owners, self.loads = assign_owners([[pc[:3] for pc in e.pieces] for e in self.entries], costs, self.world)
        for e, owner in zip(self.entries, owners):
            e.owner = owner
        self._layout()

    def _gather_fragments(self, members, flat):
        """[rank][tensor] -> (start in tensor, numel, start in that rank's partition); numel 0: no piece."""
        group = next((p._dp_group for _, p in members if getattr(p, "_dp_group", None) is not None), None)
        self.group, self.rank, self.world = group, dist.get_rank(group), dist.get_world_size(group)
        local = torch.zeros((len(members), 3), dtype=torch.int64, device=flat.device)
        for k, (_, p) in enumerate(members):
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                local[k, 0] = mapping.lp_fragment_address.start
                local[k, 1] = mapping.lp_fragment_address.numel
                local[k, 2] = mapping.hp_fragment_address.start
        gathered = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(gathered, local, group=group)
        return torch.stack(gathered).cpu().tolist()

    def _layout(self):
        me = self.rank
        self.local = [e for e in self.entries if len(e.pieces) == 1 and e.owner == me]
        self.straddlers = [e for e in self.entries if len(e.pieces) > 1]
        self.owned_straddlers = [e for e in self.straddlers if e.owner == me]
        # Gather direction: my pieces of straddlers owned elsewhere, by destination rank.
        self.send = [[] for _ in range(self.world)]   # (entry, lp_start, numel, hp_start)
        self.recv = [[] for _ in range(self.world)]   # pieces other ranks send me (owned by me)
        for e in self.straddlers:
            for rank, lp, n, hp in e.pieces:
                if rank == me and e.owner != me:
                    self.send[e.owner].append((e, lp, n, hp))
                elif e.owner == me and rank != me:
                    self.recv[rank].append((e, lp, n, hp))
        self.send_splits = [sum(x[2] for x in pieces) for pieces in self.send]
        self.recv_splits = [sum(x[2] for x in pieces) for pieces in self.recv]
        self.exchanges = bool(self.straddlers) and self.world > 1

    def extra_elements(self):
        """Elements this rank sends beyond ZeRO's own traffic per step (both directions)."""
        return sum(self.send_splits) + sum(self.recv_splits)


def flat_muon_step(optimizer, group, plan):
    x = group["params"][0]
    if x.grad is None:
        return
    g, mu = x.grad, group["momentum"]
    state = optimizer.state[x]
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(x)
    buf = state["momentum_buffer"]
    buf.lerp_(g, 1 - mu)
    u = g.lerp(buf, mu) if group["nesterov"] else buf
    dtype = DTYPES[group["ns_dtype"]]

    pending = None
    if plan.exchanges:
        send = _pack(u, [(hp, n) for pieces in plan.send for _, _, n, hp in pieces], dtype)
        received = torch.empty(sum(plan.recv_splits), dtype=dtype, device=x.device)
        pending = dist.all_to_all_single(received, send, plan.recv_splits, plan.send_splits,
                                         group=plan.group, async_op=True)

    x.mul_(1 - group["lr"] * group["weight_decay"])
    stacks = [u.narrow(0, e.pieces[0][3], e.numel).view(e.view) for e in plan.local]
    for e, o in zip(plan.local, orthogonalize_stacks(stacks, group)):
        x.narrow(0, e.pieces[0][3], e.numel).add_(o.reshape(-1), alpha=-muon_lr(group, o.shape))
    if pending is None:
        return
    pending.wait()

    fulls = {id(e): torch.empty(e.numel, dtype=dtype, device=x.device) for e in plan.owned_straddlers}
    for e in plan.owned_straddlers:
        for rank, lp, n, hp in e.pieces:
            if rank == plan.rank:
                fulls[id(e)].narrow(0, lp, n).copy_(u.narrow(0, hp, n))
    offset = 0
    for pieces in plan.recv:
        for e, lp, n, _ in pieces:
            fulls[id(e)].narrow(0, lp, n).copy_(received.narrow(0, offset, n))
            offset += n
    results = orthogonalize_stacks([fulls[id(e)].view(e.view) for e in plan.owned_straddlers], group)
    out = {id(e): o.reshape(-1) for e, o in zip(plan.owned_straddlers, results)}
    for e in plan.owned_straddlers:
        for rank, lp, n, hp in e.pieces:
            if rank == plan.rank:
                x.narrow(0, hp, n).add_(out[id(e)].narrow(0, lp, n), alpha=-muon_lr(group, e.view))

    # Return: the owner sends each holder its piece of the result (the reverse layout).
    back = torch.cat([out[id(e)].narrow(0, lp, n) for pieces in plan.recv for e, lp, n, _ in pieces]) \
        if sum(plan.recv_splits) else torch.empty(0, dtype=dtype, device=x.device)
    mine = torch.empty(sum(plan.send_splits), dtype=back.dtype, device=x.device)
    dist.all_to_all_single(mine, back, plan.send_splits, plan.recv_splits, group=plan.group)
    offset = 0
    for pieces in plan.send:
        for e, _, n, hp in pieces:
            x.narrow(0, hp, n).add_(mine.narrow(0, offset, n), alpha=-muon_lr(group, e.view))
            offset += n


def _pack(flat, ranges, dtype):
    if not ranges:
        return torch.empty(0, dtype=dtype, device=flat.device)
    return torch.cat([flat.narrow(0, start, n) for start, n in ranges]).to(dtype)

