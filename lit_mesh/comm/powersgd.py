"""PowerSGD (Vogels et al., 2019): each gradient matrix M sent as two thin factors, P = M Q and Q = M^T P.

One power-iteration step per training step with warm start (Q kept from the previous step), P orthogonalised
between the two all-reduces. The sum over ranks of low-rank approximations is exact because P and Q are
all-reduced (linear in M). 1-D tensors, and matrices too small to gain, are sent uncompressed.

`PowerSGD` runs it at one reduction site (lit_mesh/comm/compression.py picks the scheme each step): the
matrices of a flat gradient buffer are known from its `Segment`s; everything else goes uncompressed and exact.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lit_mesh.comm.fusion import fused
from lit_mesh.comm.meter import WireMeter
from lit_mesh.comm.options import CompressionOptions


@dataclass(frozen=True)
class Segment:
    """A matrix inside each chunk of a flat buffer: `rows x cols` entries from `offset` (row-major)."""

    offset: int
    rows: int
    cols: int


def segments_of_shapes(shapes: list[torch.Size]) -> list[Segment]:
    """Segments of tensors laid end to end (a 1-D tensor is a one-column matrix)."""
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) else 1
        out.append(Segment(offset, rows, numel // rows if rows else 0))
        offset += numel
    return out


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


class PowerSGD:
    """PowerSGD at one reduction site: the warm-started Q of each compressed matrix, and the reduction."""

    def __init__(self, site: str, options: CompressionOptions) -> None:
        self.site = site  # seeds each matrix's first Q, the same on every rank
        self.options = options
        self.qs: dict[int, Tensor] = {}
        self._uncompressed_index: dict[tuple, Tensor] = {}

    def _uncompressed(self, chunk_numel: int, compressed: list[Segment], device: torch.device) -> Tensor:
        """The positions of a chunk outside the compressed matrices, ascending, made on the device once per layout
        from the segments (host integers): later steps index with them, where a boolean mask would read the device
        (its nonzero) every call."""
        key = (chunk_numel, tuple(compressed), device)
        if key not in self._uncompressed_index:
            ranges, start = [], 0
            for s in sorted(compressed, key=lambda s: s.offset):
                ranges.append((start, s.offset))
                start = s.offset + s.rows * s.cols
            ranges.append((start, chunk_numel))
            pieces = [torch.arange(a, b, device=device) for a, b in ranges if b > a]
            index = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long, device=device)
            self._uncompressed_index[key] = index
        return self._uncompressed_index[key]

    def reduce(
        self,
        x: Tensor,
        n: int,
        group: Any,
        dim: str,
        segments: Optional[list[Segment]],
        keep_chunk: Optional[int],
        meter: WireMeter,
    ) -> tuple[Tensor, Tensor]:
        """keep_chunk None: all-reduce (x is one chunk); else reduce-scatter of x's n chunks to that chunk.
        Returns (the result, what this rank's input contributed to it in x's layout: for error feedback)."""
        chunks = 1 if keep_chunk is None else n
        chunk_numel = x.numel() // chunks
        rank = self.options.powersgd_rank
        segments = segments or []
        if sum(s.rows * s.cols for s in segments) != chunk_numel or any(s.cols == 0 for s in segments):
            segments = []  # no matrix layout known: everything goes uncompressed
        per_chunk = x.view(chunks, chunk_numel)
        work = torch.promote_types(x.dtype, torch.float32)
        compressed = [i for i, s in enumerate(segments) if worth_compressing(chunks * s.rows, s.cols, rank)]
        matrices = []
        for i in compressed:
            s = segments[i]
            rows = per_chunk[:, s.offset : s.offset + s.rows * s.cols].reshape(chunks * s.rows, s.cols)
            matrices.append(rows.to(work))
            if i not in self.qs:
                self.qs[i] = initial_q(s.cols, rank, f"{self.site}/{i}", self.options.seed, x.device).to(work)
        cap = int(self.options.bucket_mb * 2**20)

        def all_reduce_sum(tensors: list[Tensor]) -> None:
            def one(flat: Tensor) -> None:
                dist.all_reduce(flat, group=group)
                meter.sent(dim, "all_reduce", flat, n)

            fused(tensors, cap, one)

        approximations = low_rank_sum(matrices, [self.qs[i] for i in compressed], all_reduce_sum)
        sent = torch.zeros_like(per_chunk)  # what this rank's input contributes to the result, input layout
        out_chunk = torch.zeros(chunk_numel, dtype=x.dtype, device=x.device)
        mine = 0 if keep_chunk is None else keep_chunk
        for i, approx in zip(compressed, approximations):
            s = segments[i]
            mean = approx / n  # every rank contributes the mean approximation; the sum is n times it
            sent[:, s.offset : s.offset + s.rows * s.cols] = mean.reshape(chunks, -1).to(x.dtype)
            out_chunk[s.offset : s.offset + s.rows * s.cols] = approx.reshape(chunks, -1)[mine].to(x.dtype)
        # the rest, uncompressed and exact: one collective for all of it (already fused in this buffer)
        uncompressed = self._uncompressed(chunk_numel, [segments[i] for i in compressed], x.device)
        rest = per_chunk[:, uncompressed]
        sent[:, uncompressed] = rest
        if rest.numel():
            if keep_chunk is None:
                reduced_rest = rest.reshape(-1).clone()
                dist.all_reduce(reduced_rest, group=group)
                meter.sent(dim, "all_reduce", reduced_rest, n)
            else:
                reduced_rest = torch.empty(rest.shape[1], dtype=x.dtype, device=x.device)
                dist.reduce_scatter_tensor(reduced_rest, rest.reshape(-1).contiguous(), group=group)
                meter.sent(dim, "reduce_scatter", rest, n)
            out_chunk[uncompressed] = reduced_rest
        return out_chunk, sent.view(-1)
