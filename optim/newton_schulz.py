"""Newton-Schulz orthogonalisation of stacks of same-shape matrices, and Muon's lr adjustment.

Both kernels take a stack `[N, A, B]` and return the stack of approximately
orthogonalised matrices in the compute dtype. `standard` performs, operation for
operation, what `torch.optim.Muon` does to one matrix (which is the numerical
reference); `gram` iterates on the small Gram matrix and does fewer flops when the
matrix is rectangular.
"""
import math
from collections import defaultdict
from typing import Any, Sequence

import torch

from optim.config import ADJUST_LR_FNS, NS_DTYPES, NS_METHODS
from optim.routing import matrix_view

DTYPES = {name: getattr(torch, name) for name in NS_DTYPES}

# Re-anchor the Gram iteration after this many steps: fold the accumulated polynomial
# back into X and recompute X X^T, so rounding in the small matrices does not pile up.
GRAM_RESTART = 2
# Cap on the elements of one batched Newton-Schulz stack. On GPUs batching same-shape matrices
# saves kernel launches; on CPUs a stack that outgrows the caches runs slower than one matrix at
# a time (measured 1.25x slower for 34 stacked 512 x 512 matrices), so there only small
# matrices are batched.
MAX_STACK_NUMEL = {"cuda": 1 << 26, "cpu": 1 << 18}


def ns_flops(a: int, b: int, steps: int = 5) -> int:
    """Flops of the standard iteration on one a x b matrix (m = the smaller side)."""
    m, n = min(a, b), max(a, b)
    return steps * (4 * m * m * n + 2 * m ** 3)


def matrix_cost(shape: Sequence[int], steps: int = 5) -> int:
    """Flops of the standard iteration on a tensor of `shape`, seen as its matrices (`matrix_view`)."""
    count, a, b = matrix_view(shape)
    return count * ns_flops(a, b, steps)


def adjusted_lr(lr: float, adjust_lr_fn: str, a: int, b: int) -> float:
    """Muon's per-shape lr: the same formulas as torch.optim.Muon's `_adjust_lr`."""
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    raise ValueError(f"adjust_lr_fn is {adjust_lr_fn!r}; expected one of {', '.join(ADJUST_LR_FNS)}")


def orthogonalize(stack: torch.Tensor, coefficients: Sequence[float], steps: int, dtype: torch.dtype,
                  method: str = "standard", eps: float = 1e-7) -> torch.Tensor:
    """Orthogonalise every matrix of `stack` [N, A, B]; returns [N, A, B] in `dtype`."""
    if method not in NS_METHODS:
        raise ValueError(f"ns_method is {method!r}; expected one of {', '.join(NS_METHODS)}")
    a, b, c = coefficients
    x = stack.to(dtype)  # cast first, then normalise, exactly as torch.optim.Muon
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    if method == "gram" and x.size(-1) > x.size(-2):
        x = _gram_iterations(x, a, b, c, steps)
    else:
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def _gram_iterations(x: torch.Tensor, a: float, b: float, c: float, steps: int) -> torch.Tensor:
    """The same polynomial iteration written on R = X X^T (n x n, n < m).

    X_{k+1} = P_k X_k with P_k = aI + bR_k + cR_k^2, so X_k = Q_k X_0 with
    Q_{k+1} = P_k Q_k and R_{k+1} = P_k R_k P_k (P_k commutes with R_k): the wide
    side m enters only when R is (re)computed and in the final Q X.
    """
    eye = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
    r = x @ x.mT
    q = None
    for i in range(steps):
        if i == GRAM_RESTART:
            x = q @ x
            r = x @ x.mT
            q = None
        p = torch.baddbmm(b * r, r, r, alpha=c) + a * eye
        q = p if q is None else p @ q
        if i + 1 < steps and i + 1 != GRAM_RESTART:
            r = p @ r @ p
    return q @ x


def muon_lr(group: dict[str, Any], stack_shape: Sequence[int]) -> float:
    """The lr applied to an orthogonalised [count, A, B] update of this group."""
    return adjusted_lr(group["lr"], group["adjust_lr_fn"], stack_shape[-2], stack_shape[-1]) * group["lr_scale"]


def orthogonalize_stacks(stacks: list[torch.Tensor], group: dict[str, Any]) -> list[torch.Tensor]:
    """Newton-Schulz on a list of [count, A, B] stacks: same-shape matrices batched, up to the cap."""
    by_shape: defaultdict[tuple, list] = defaultdict(list)
    for i, s in enumerate(stacks):
        by_shape[tuple(s.shape[1:])] += [(i, j) for j in range(s.shape[0])]
    parts = [[None] * s.shape[0] for s in stacks]
    dtype = DTYPES[group["ns_dtype"]]
    for (a, b), matrices in by_shape.items():
        cap = MAX_STACK_NUMEL.get(stacks[matrices[0][0]].device.type, MAX_STACK_NUMEL["cuda"])
        per_chunk = max(1, cap // (a * b))
        for start in range(0, len(matrices), per_chunk):
            chunk = matrices[start:start + per_chunk]
            batch = torch.cat([stacks[i].narrow(0, j, 1) for i, j in chunk]) if len(chunk) > 1 \
                else stacks[chunk[0][0]].narrow(0, chunk[0][1], 1)
            result = orthogonalize(batch, group["ns_coefficients"], group["ns_steps"], dtype,
                                   group["ns_method"], group["muon_eps"])
            for (i, j), o in zip(chunk, result.split(1)):
                parts[i][j] = o
    return [p[0] if len(p) == 1 else torch.cat(p) for p in parts]
