"""Closed-form bytes one rank sends per transformer block (forward + backward) under each tp_mode, in the byte
counter's model (lit_mesh/monitor/comm.py: ring all-reduce 2(n-1)/n of the tensor; all-gather, reduce-scatter,
broadcast and reduce (n-1)/n of it). tests/workers/tp_grid.py checks them against the counter; benchmarks/tp_bytes.py
tabulates them.

Notation: b tokens in the tp group's batch (batch x sequence), a block of a zoo GPT with hidden dim `dim`, `heads`
query and `kv_heads` key/value heads, SwiGLU width `ffn`; p = tp ranks; e bytes per activation/weight element.

1-D (sequence parallel), Megatron's count, which lit-mesh sends (lit_mesh/parallel/tensor.py: each attention and MLP
region gathers its input once and hands it on as a DTensor, so the column-wise projections' input gradients are
summed before one reduce-scatter): per block 2 all-gathers of the (b, dim) inputs of attention and MLP and
2 reduce-scatters of their outputs, mirrored in backward: 8 (p-1)/p b dim e.
2-D / 2.5-D (SUMMA on depth d x q x q, p = d q^2; 2-D is d = 1): per linear (in -> out), q steps of forward
broadcasts of an X block (b/(dq) x in/q) and a W block (in/q x out/q), backward the same two broadcasts and the two
reduces (dX, dW blocks): 3 (q-1) (b in / d + in out) / q^2 e; 2.5-D adds the depth all-reduce of dW:
2 (d-1)/d in out / q^2 e. Per RMSNorm: the fp32 sum of squares (b/(dq) numbers) all-reduced over a row in forward and
backward, 2 x 2(q-1)/q b/(dq) 4, and its weight's gradient block summed over the d q ranks sharing it,
2(dq-1)/(dq) dim/q e.
3-D (q x q x q, p = q^3; lit_mesh/parallel/grid/cube.py): per linear (in -> out), the input block (b/q x in/q), the
weight block (in/q x out/q) and the product block (b/q x out/q) each cross a q-rank group twice (all-gathered one
way, reduce-scattered the other): 2 (q-1)/q^3 (b in + in out + b out) e. Per RMSNorm: the fp32 sum of squares (b/q^2
numbers) all-reduced over q ranks in forward and backward, 2 x 2(q-1)/q b/q^2 4, and its weight's gradient block
summed over the q^2 ranks sharing it, 2(q^2-1)/q^2 dim/q e.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class BlockShape:
    """One transformer block's sizes and the tokens it sees (the tp group's batch x sequence)."""

    tokens: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    element_bytes: int = 4

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of wq, wk, wv, wo, w1, w3, w2."""
        kv = self.dim // self.heads * self.kv_heads
        return [
            (self.dim, self.dim),
            (self.dim, kv),
            (self.dim, kv),
            (self.dim, self.dim),
            (self.dim, self.ffn),
            (self.dim, self.ffn),
            (self.ffn, self.dim),
        ]


def bytes_1d(s: BlockShape, p: int) -> float:
    """1-D TP with sequence parallelism (Megatron's count, lit-mesh's bytes), per rank per block."""
    return 8 * (p - 1) / p * s.tokens * s.dim * s.element_bytes


def linear_bytes_summa(tokens: int, n_in: int, n_out: int, q: int, d: int, element_bytes: int) -> float:
    """One SUMMA linear, forward + backward, per rank (2-D: d = 1)."""
    summa = 3 * (q - 1) * (tokens * n_in / d + n_in * n_out) / q**2
    depth = 2 * (d - 1) / d * n_in * n_out / q**2
    return (summa + depth) * element_bytes


def norm_bytes_summa(s: BlockShape, q: int, d: int) -> float:
    squares = 2 * 2 * (q - 1) / q * s.tokens / (d * q) * 4  # fp32 sums of squares, forward and backward
    weight = 2 * (d * q - 1) / (d * q) * s.dim / q * s.element_bytes
    return squares + weight


def bytes_summa(s: BlockShape, q: int, d: int = 1) -> float:
    """2-D (d = 1) or 2.5-D SUMMA, per rank per block: seven linears and two RMSNorms."""
    linears = sum(linear_bytes_summa(s.tokens, n_in, n_out, q, d, s.element_bytes) for n_in, n_out in s.linears())
    return linears + 2 * norm_bytes_summa(s, q, d)


def bytes_2d(s: BlockShape, p: int) -> float:
    q = round(p**0.5)
    assert q * q == p, f"2-D needs p = q * q, not {p}"
    return bytes_summa(s, q)


def bytes_2_5d(s: BlockShape, p: int, d: int) -> float:
    q = round((p // d) ** 0.5)
    assert d * q * q == p, f"2.5-D needs p = d * q * q, not {p} with d = {d}"
    return bytes_summa(s, q, d)


def linear_bytes_3d(tokens: int, n_in: int, n_out: int, q: int, element_bytes: int) -> float:
    """One 3-D linear, forward + backward, per rank."""
    return 2 * (q - 1) / q**3 * (tokens * n_in + n_in * n_out + tokens * n_out) * element_bytes


def norm_bytes_3d(s: BlockShape, q: int) -> float:
    squares = 2 * 2 * (q - 1) / q * s.tokens / q**2 * 4  # fp32 sums of squares, forward and backward
    weight = 2 * (q * q - 1) / (q * q) * s.dim / q * s.element_bytes
    return squares + weight


def bytes_3d(s: BlockShape, p: int) -> float:
    """3-D, per rank per block: seven linears and two RMSNorms."""
    q = round(p ** (1 / 3))
    assert q**3 == p, f"3-D needs p = q * q * q, not {p}"
    linears = sum(linear_bytes_3d(s.tokens, n_in, n_out, q, s.element_bytes) for n_in, n_out in s.linears())
    return linears + 2 * norm_bytes_3d(s, q)


# Bytes per rank per block of each grid tp_mode: f(shape, tp, tp_depth); its grid sizes: grid.grid_shape.
GRID_BLOCK_BYTES: dict[str, Callable[[BlockShape, int, Optional[int]], float]] = {
    "2d": lambda s, p, d: bytes_2d(s, p),
    "2.5d": lambda s, p, d: bytes_2_5d(s, p, d or 1),
    "3d": lambda s, p, d: bytes_3d(s, p),
}
