"""PowerSGD (Vogels et al., 2019): each gradient matrix M sent as two thin factors, P = M Q and Q = M^T P.

One power-iteration step per training step with warm start (Q kept from the previous step), P orthogonalised
between the two all-reduces. The sum over ranks of low-rank approximations is exact because P and Q are
all-reduced (linear in M). 1-D tensors, and matrices too small to gain, are sent uncompressed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import Tensor


def worth_compressing(rows: int, cols: int, rank: int) -> bool:
    """Send P (rows x r) and Q (cols x r) only when they are smaller than the matrix and of full rank r."""
    return cols > 1 and min(rows, cols) > rank and (rows + cols) * rank < rows * cols


def initial_q(cols: int, rank: int, key: str, seed: int, device: torch.device) -> Tensor:
    """The first Q: the same on every rank (seeded by the site's name, not by the rank)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(cols, rank, generator=generator).to(device)


def orthogonalize(p: Tensor) -> Tensor:
    """Orthonormal columns spanning P (reduced QR)."""
    return torch.linalg.qr(p, mode="reduced").Q


def low_rank_sum(
    matrices: list[Tensor], qs: list[Tensor], all_reduce_sum: Callable[[list[Tensor]], None]
) -> list[Tensor]:
    """P Q^T approximations of the sum over ranks of each matrix; updates `qs` in place (the warm start).

    all_reduce_sum sums a list of tensors over the group in place (fused into buckets by the caller).
    """
    ps = [m @ q for m, q in zip(matrices, qs)]
    all_reduce_sum(ps)
    ps = [orthogonalize(p) for p in ps]
    new_qs = [m.T @ p for m, p in zip(matrices, ps)]
    all_reduce_sum(new_qs)
    for q, new in zip(qs, new_qs):
        q.copy_(new)
    return [p @ q.T for p, q in zip(ps, new_qs)]
