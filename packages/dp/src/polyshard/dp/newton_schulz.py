"""Newton-Schulz orthogonalisation, the heart of Muon (Jordan et al. 2024; Liu et al., "Muon is
Scalable for LLM Training", 2502.16982, the Moonlight report).

Muon replaces a matrix's momentum ``M = U S V^T`` by (about) ``U V^T``: every singular value pushed
towards 1, so the update moves all directions of the matrix alike. Five iterations of the quintic
``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` do it without an SVD; the coefficients
(3.4445, -4.7750, 2.0315) make the map rise steeply near 0, so small singular values come up fast,
at the price of leaving each one somewhere in about [0.7, 1.2] instead of exactly 1, which
training does not mind.

Shapes: ``(..., m, n)``; leading dims are a batch of independent matrices (a stack of experts is
orthogonalised expert by expert).

The iteration runs in float32. Keller Jordan's reference runs it in bfloat16 on GPUs, where bf16
matmuls are several times faster; here the gather-orthogonalise-scatter runs on one owner rank per
matrix, its cost is a few matmuls of one matrix, and float32 keeps a distributed run within
round-off of a single-process one (bf16 would put ~1e-2 relative noise into every update and make
parity checks meaningless). On CPUs bf16 matmuls are not faster anyway.
"""

from __future__ import annotations

import math

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic iteration (Keller Jordan's, also Moonlight's)."""


@torch.no_grad()
def orthogonalise(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """About ``U V^T`` of each matrix ``update[..., :, :]`` (float32, a new tensor).

    A zero matrix (e.g. padding, or an expert with no gradient yet) stays zero.
    """
    a, b, c = COEFFICIENTS
    x = update.float()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide side: A = X X^T is then the smaller square
        x = x.mT
    # Frobenius norm <= 1 bounds every singular value by 1, where the iteration converges.
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT  # (..., m, n) @ (..., n, m) -> (..., m, m)
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    result: torch.Tensor = x.transpose(-2, -1) if tall else x
    return result


def shape_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Moonlight's ``0.2 * sqrt(max(m, n))`` for an ``(..., m, n)`` matrix: it gives the orthogonalised
    update the RMS of a typical AdamW update (~0.2), so AdamW's learning rate and weight decay carry
    over unchanged (Liu et al. 2025, section 2.2)."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))
