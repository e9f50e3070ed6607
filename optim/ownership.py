"""Who orthogonalises which matrix under ZeRO, and the parameter order that balances it.

ZeRO cuts the flat buffer of a param group into W equal ranges; rank r holds range r.
Every Muon tensor is orthogonalised by exactly one rank, its *owner*:
- a tensor wholly inside rank r's range is owned by r (no communication at all);
- a tensor that straddles ranges (a *straddler*) is owned by one of the ranks holding a
  piece of it: the least loaded one so far, straddlers taken by decreasing cost
  (ties: the rank holding the larger piece, then the lower rank).
`assign_owners` is the one rule; every rank evaluates it on the same layout, so all agree.

Load is Newton-Schulz flops (`ns_flops`). Equal element counts do not mean equal cost
(a matrix with smaller side m costs ~4m flops per element per step), so the order of
tensors inside the group, chosen once at construction from the world size, decides the
balance: `balanced_order` packs tensors into W bins of equal size by decreasing cost,
each into the least loaded bin with room, lays the bins out one after the other with the
smallest tensor of each bin at its end (so a boundary that cuts a tensor cuts a cheap
one), and keeps this order only if the predicted max load beats the model order.
"""
from typing import NamedTuple
from typing import Any, NamedTuple, Sequence

ZERO_ALIGNMENT = 2  # DeepSpeed pads a group to a multiple of 2 * W elements (nccl_start_alignment_factor)


class Piece(NamedTuple):
    """The part of one tensor that lies in one rank's ZeRO partition."""
    rank: int
    start: int
    """First element of the piece in the flattened tensor."""
    numel: int
    offset: int
    """First element of the piece in that rank's partition."""


def partition_size(total_numel: int, world_size: int) -> int:
    align = ZERO_ALIGNMENT * world_size
    return -(-total_numel // align) * align // world_size


def predicted_pieces(numels: Sequence[int], world_size: int) -> list[list[Piece]]:
    """The pieces (a list of `Piece`) of each tensor, the tensors laid out back to back."""
    size = partition_size(sum(numels), world_size)
    pieces, offset = [], 0
    for n in numels:
        own = []
        for r in range(offset // size, (offset + n - 1) // size + 1):
            lo, hi = max(offset, r * size), min(offset + n, (r + 1) * size)
            own.append(Piece(r, lo - offset, hi - lo, lo - r * size))
        pieces.append(own)
        offset += n
    return pieces


def assign_owners(pieces: Sequence[Sequence[Any]], costs: Sequence[int],
                  world_size: int) -> tuple[list[int], list[int]]:
    """Owner rank of each tensor and the Newton-Schulz load of each rank (see module docstring).

    `pieces[k]`: tensor k's pieces (`Piece`s, or anything with rank and numel), `costs[k]` its cost."""
    owners, loads = [0] * len(pieces), [0] * world_size  # every tensor gets its owner below
    straddlers = []
    for k, own in enumerate(pieces):
        if len(own) == 1:
            owners[k] = own[0].rank
            loads[own[0].rank] += costs[k]
        else:
            straddlers.append(k)
    for k in sorted(straddlers, key=lambda k: (-costs[k], k)):
        rank = min(pieces[k], key=lambda piece: (loads[piece.rank], -piece.numel, piece.rank)).rank
        owners[k] = rank
        loads[rank] += costs[k]
    return owners, loads


def _packed_order(numels: Sequence[int], costs: Sequence[int], world_size: int) -> list[int]:
    size = partition_size(sum(numels), world_size)
    bins: list[list[int]] = [[] for _ in range(world_size)]
    room, load, leftover = [size] * world_size, [0] * world_size, []
    for k in sorted(range(len(numels)), key=lambda k: (-costs[k], -numels[k], k)):
        fits = [r for r in range(world_size) if room[r] >= numels[k]]
        if not fits:
            leftover.append(k)
            continue
        r = min(fits, key=lambda r: (load[r], r))
        bins[r].append(k)
        room[r] -= numels[k]
        load[r] += costs[k]
    leftover.sort(key=lambda k: numels[k])
    order, pos = [], 0
    for r, members in enumerate(bins):
        members.sort(key=lambda k: (-numels[k], k))  # smallest last: it meets the boundary
        order += members
        pos += sum(numels[k] for k in members)
        if r < world_size - 1 and leftover and pos < (r + 1) * size:
            k = leftover.pop(0)  # fill the gap: this one straddles into the next range
            order.append(k)
            pos += numels[k]
    return order + leftover


def predicted_max_load(numels: Sequence[int], costs: Sequence[int], order: Sequence[int], world_size: int) -> int:
    pieces = predicted_pieces([numels[k] for k in order], world_size)
    return max(assign_owners(pieces, [costs[k] for k in order], world_size)[1])


def balanced_order(numels: Sequence[int], costs: Sequence[int], world_size: int) -> list[int]:
    """Indices of the tensors in the order to hand to ZeRO at this world size."""
    identity = list(range(len(numels)))
    if world_size <= 1 or not numels:
        return identity
    packed = _packed_order(numels, costs, world_size)
    if predicted_max_load(numels, costs, packed, world_size) < predicted_max_load(numels, costs, identity,
                                                                                  world_size):
        return packed
    return identity
