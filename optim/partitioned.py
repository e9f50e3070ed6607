"""Muon on DeepSpeed's flat fp32 partitions: owner-centric Newton-Schulz (docs/optimizer.md).

Under ZeRO-1/2 (and DeepSpeed's bf16 optimizer) a Muon group's step() sees one flat fp32
partition `x` with its flat gradient; the model tensors are cut across ranks. Each model
tensor that has a piece on this rank carries DeepSpeed's mapping of it (read through
optim/deepspeed_adapter.py): the piece's start in the tensor and in the partition. The
plan is built once from these addresses, gathered from every rank:
- momentum lives in the flat layout (state key "momentum_buffer", same shape as `x`), so
  the momentum and Nesterov update are elementwise over the partition (optim/update.py);
- `assign_owners` gives each tensor one owner; tensors wholly inside this partition are
  orthogonalised in place, straddlers are gathered to their owner in one all-to-all
  (started asynchronously, overlapped with the local Newton-Schulz), orthogonalised, and
  the owner returns every other rank's piece of the result in a second all-to-all.
Pieces travel in the Newton-Schulz dtype, which is also the first cast the algorithm makes.

`owner_step` is MuonAdamW's default `flat_step`; any other strategy with its signature
(for example the benchmark's gather-everything variant) can be given to MuonAdamW instead.
"""
from typing import Any, List, NamedTuple, Sequence

import torch
import torch.distributed as tdist

from optim.deepspeed_adapter import data_parallel_group, fragment, has_fragment_mapping
from optim.newton_schulz import DTYPES, matrix_cost, muon_lr, orthogonalize_stacks
from optim.ownership import Piece, assign_owners
from optim.routing import matrix_view
from optim.update import decay_weights


class Entry(NamedTuple):
    """One Muon tensor of the group: its matrix view, its pieces (one per rank holding part of it), its owner."""
    name: str
    view: tuple
    numel: int
    pieces: List[Piece]
    owner: int


class Transfer(NamedTuple):
    """A piece of a straddler that crosses ranks: to its owner (gather), and back (return)."""
    entry: Entry
    piece: Piece


class FlatMuonPlan:
    """Who owns what, and the all-to-all layouts, for one flat Muon group on this rank.

    `group`, `rank`, `world`: the data-parallel process group and this rank's place in it;
    `entries`: every tensor of the group (`Entry`); `loads`: Newton-Schulz flops per rank."""

    def __init__(self, members: Sequence[tuple[str, torch.Tensor]], flat: torch.Tensor, ns_steps: int) -> None:
        self.partition_numel = flat.numel()
        if not any(has_fragment_mapping(p) for _, p in members):
            raise RuntimeError("MuonAdamW: a param group holds one flat tensor but the model's parameters carry "
                               "no DeepSpeed _hp_mapping; only ZeRO-1/2 partitions are supported in flat form")
        self.group = data_parallel_group([p for _, p in members])
        self.rank, self.world = tdist.get_rank(self.group), tdist.get_world_size(self.group)
        table = _gather_fragments(members, flat.device, self.group, self.world)
        pieces = []
        for k, (name, p) in enumerate(members):
            own = [Piece(r, *table[r][k]) for r in range(self.world) if table[r][k][1] > 0]
            if sum(pc.numel for pc in own) != p.numel():
                raise RuntimeError(f"MuonAdamW: the ZeRO pieces of '{name}' cover {sum(pc.numel for pc in own)} "
                                   f"of its {p.numel()} elements; was the optimizer built from the model that "
                                   "was given to deepspeed.initialize?")
            pieces.append(own)
        owners, self.loads = assign_owners(pieces, [matrix_cost(p.shape, ns_steps) for _, p in members], self.world)
        self.entries = [Entry(name, matrix_view(p.shape), p.numel(), own, owner)
                        for (name, p), own, owner in zip(members, pieces, owners)]
        self._layout()

    def _layout(self) -> None:
        me = self.rank
        self.local = [e for e in self.entries if len(e.pieces) == 1 and e.owner == me]
        self.straddlers = [e for e in self.entries if len(e.pieces) > 1]
        self.owned_straddlers = [e for e in self.straddlers if e.owner == me]
        self.send: list[list] = [[] for _ in range(self.world)]  # per owner rank: my pieces of its straddlers
        self.recv: list[list] = [[] for _ in range(self.world)]  # per holder rank: its pieces of my straddlers
        for e in self.straddlers:
            for piece in e.pieces:
                if piece.rank == me and e.owner != me:
                    self.send[e.owner].append(Transfer(e, piece))
                elif e.owner == me and piece.rank != me:
                    self.recv[piece.rank].append(Transfer(e, piece))
        self.send_splits = [sum(t.piece.numel for t in transfers) for transfers in self.send]
        self.recv_splits = [sum(t.piece.numel for t in transfers) for transfers in self.recv]
        self.exchanges = bool(self.straddlers) and self.world > 1

    def my_pieces(self, entry: Entry) -> list[Piece]:
        """The pieces of `entry` that lie in this rank's partition."""
        return [piece for piece in entry.pieces if piece.rank == self.rank]

    def extra_elements(self) -> int:
        """Elements this rank sends beyond ZeRO's own traffic per step (both directions)."""
        return sum(self.send_splits) + sum(self.recv_splits)


def _gather_fragments(members: Sequence[tuple[str, torch.Tensor]], device: torch.device,
                      group: tdist.ProcessGroup | None, world: int) -> list[list[list[int]]]:
    """[rank][tensor] -> (start in tensor, numel, start in that rank's partition); numel 0: no piece."""
    rows = [fragment(p) or (0, 0, 0) for _, p in members]
    local = torch.tensor(rows, dtype=torch.int64).reshape(len(members), 3).to(device)  # one copy to the device
    gathered = [torch.empty_like(local) for _ in range(world)]
    tdist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).cpu().tolist()


def owner_step(x: torch.Tensor, u: torch.Tensor, group: dict[str, Any], plan: FlatMuonPlan) -> None:
    """Orthogonalise the update `u` of the flat partition `x` (its momentum already applied),
    every matrix on its owner only, and apply it to `x` with weight decay."""
    dtype = DTYPES[group["ns_dtype"]]
    pending = None
    if plan.exchanges:
        send = _pack(u, [t.piece for transfers in plan.send for t in transfers], dtype)
        received = torch.empty(sum(plan.recv_splits), dtype=dtype, device=x.device)
        pending = tdist.all_to_all_single(received, send, plan.recv_splits, plan.send_splits,
                                         group=plan.group, async_op=True)

    decay_weights(x, group)
    stacks = [u.narrow(0, e.pieces[0].offset, e.numel).view(e.view) for e in plan.local]
    for e, o in zip(plan.local, orthogonalize_stacks(stacks, group)):
        x.narrow(0, e.pieces[0].offset, e.numel).add_(o.reshape(-1), alpha=-muon_lr(group, o.shape))
    if pending is None:
        return
    pending.wait()

    fulls = {e.name: torch.empty(e.numel, dtype=dtype, device=x.device) for e in plan.owned_straddlers}
    for e in plan.owned_straddlers:
        for piece in plan.my_pieces(e):
            fulls[e.name].narrow(0, piece.start, piece.numel).copy_(u.narrow(0, piece.offset, piece.numel))
    offset = 0
    for transfers in plan.recv:
        for e, piece in transfers:
            fulls[e.name].narrow(0, piece.start, piece.numel).copy_(received.narrow(0, offset, piece.numel))
            offset += piece.numel
    results = orthogonalize_stacks([fulls[e.name].view(e.view) for e in plan.owned_straddlers], group)
    out = {e.name: o.reshape(-1) for e, o in zip(plan.owned_straddlers, results)}
    for e in plan.owned_straddlers:
        for piece in plan.my_pieces(e):
            x.narrow(0, piece.offset, piece.numel).add_(out[e.name].narrow(0, piece.start, piece.numel),
                                                        alpha=-muon_lr(group, e.view))

    # Return: the owner sends each holder its piece of the result (the reverse layout).
    back = torch.cat([out[e.name].narrow(0, piece.start, piece.numel) for transfers in plan.recv
                      for e, piece in transfers]) if sum(plan.recv_splits) else torch.empty(0, dtype=dtype,
                                                                                          device=x.device)
    mine = torch.empty(sum(plan.send_splits), dtype=back.dtype, device=x.device)
    tdist.all_to_all_single(mine, back, plan.send_splits, plan.recv_splits, group=plan.group)
    offset = 0
    for transfers in plan.send:
        for e, piece in transfers:
            x.narrow(0, piece.offset, piece.numel).add_(mine.narrow(0, offset, piece.numel),
                                                        alpha=-muon_lr(group, e.view))
            offset += piece.numel


def _pack(flat: torch.Tensor, pieces: Sequence[Piece], dtype: torch.dtype) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, dtype=dtype, device=flat.device)
    return torch.cat([flat.narrow(0, piece.offset, piece.numel) for piece in pieces]).to(dtype)
