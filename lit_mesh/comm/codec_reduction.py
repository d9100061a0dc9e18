"""The reductions of the chunk codecs (fp16/bf16 casts, 1-bit signs, top-k; lit_mesh/comm/codecs.py).

Codes of signs or top-k entries do not add up on the wire, so:
- reduce-scatter: every rank encodes each of the n chunks of its (error-corrected) input and sends chunk j to
  rank j by all-to-all; rank j decodes and sums them locally;
- all-reduce: that reduce-scatter, then a gather half: each rank re-encodes its reduced chunk (with a second,
  rank-local residual: error feedback on both sides, as DeepSpeed's worker and server errors) and all-gathers
  the codes.
1-bit's per-entry scales (lit_mesh/comm/entry_scales.py) arrive as `scales` in x's layout: x / scales is encoded
and the decoded codes are multiplied back.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lit_mesh.comm.codecs import Codec
from lit_mesh.comm.meter import WireMeter


class CodecReduction:
    """The chunk-codec reductions of one site, and the residual of its gather half (this rank's reduced chunk)."""

    def __init__(self, error_feedback: bool) -> None:
        self.error_feedback = error_feedback
        self.server_residual: Optional[Tensor] = None

    def reduce_scatter(
        self, x: Tensor, n: int, group: Any, codec: Codec, scales: Optional[Tensor], meter: WireMeter, dim: str
    ) -> tuple[Tensor, Tensor]:
        """Every rank's chunk j of x, encoded, sent to rank j and summed there. Returns (this rank's chunk of the
        sum, what this rank sent in x's layout: for error feedback)."""
        chunks = x.view(n, -1)
        unit = _per_chunk(scales, n, x)
        payloads, decoded = _encode_chunks(chunks / unit, codec)
        sent = (decoded * unit).view(-1)
        received = torch.empty_like(payloads)
        dist.all_to_all_single(received, payloads, group=group)
        meter.sent(dim, "all_to_all", payloads, n)
        work = torch.promote_types(x.dtype, torch.float32)
        mine = unit[dist.get_rank(group)].to(work)
        return codec.decode_rows(received, chunks.shape[1], work).sum(0) * mine, sent

    def all_reduce(
        self,
        x: Tensor,
        n: int,
        group: Any,
        codec: Codec,
        scales: Optional[Tensor],
        meter: WireMeter,
        dim: str,
        average: bool,
    ) -> tuple[Tensor, Tensor]:
        """The sum (mean when `average`) over ranks of x, by reduce-scatter and gather half. Returns (it, what this
        rank sent of x, in x's layout)."""
        length = x.numel()
        reduced, sent = self.reduce_scatter(padded(x, n), n, group, codec, scales, meter, dim)
        if average:
            reduced = reduced / n
        result = self.all_gather(reduced, n, group, codec, meter, dim, _per_chunk(scales, n, x), x.dtype)
        return result[:length], sent[:length]  # the padding is no signal

    def all_gather(
        self,
        piece: Tensor,
        n: int,
        group: Any,
        codec: Codec,
        meter: WireMeter,
        dim: str,
        unit: Optional[Tensor] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> Tensor:
        """The gather half: this rank's piece re-encoded (with its own residual: error feedback) and every rank's
        codes all-gathered and decoded, end to end. `unit`: 1-bit's per-entry scales as n chunk rows."""
        chunk, dtype = piece.numel(), dtype or piece.dtype
        unit = torch.ones(n, 1, dtype=piece.dtype, device=piece.device) if unit is None else unit
        mine = unit[dist.get_rank(group)]
        if self.server_residual is not None:
            piece = piece + self.server_residual
        payload = codec.encode(piece / mine)
        if self.error_feedback:
            self.server_residual = piece - codec.decode(payload, chunk, piece.dtype) * mine
        gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=piece.device)
        dist.all_gather_into_tensor(gathered, payload, group=group)
        meter.sent(dim, "all_gather", gathered, n)
        return (codec.decode_rows(gathered.view(n, -1), chunk, dtype) * unit).flatten()

    def fold_server_residual(self, x: Tensor, n: int, group: Any, average: bool) -> None:
        """A scheme without a gather half takes over what the last codec all-reduce kept back: it joins this rank's
        input at its chunk (x n when averaging, so that the mean over ranks gains it)."""
        if self.server_residual is None:
            return
        chunk = self.server_residual.numel()
        start = dist.get_rank(group) * chunk
        part = x[start : start + chunk]
        part += (self.server_residual * (n if average else 1))[: part.numel()].to(x.dtype)
        self.server_residual = None


def _encode_chunks(chunks: Tensor, codec: Codec) -> tuple[Tensor, Tensor]:
    """(payloads n x B, what the receivers will decode, n x c): one batch of kernels for the n chunks."""
    payloads = codec.encode_rows(chunks)
    return payloads, codec.decode_rows(payloads, chunks.shape[1], chunks.dtype)


def _per_chunk(scales: Optional[Tensor], n: int, x: Tensor) -> Tensor:
    """1-bit's per-entry scales as n chunk rows in x's dtype (ones, broadcast over each chunk, without scales)."""
    return torch.ones(n, 1, dtype=x.dtype, device=x.device) if scales is None else scales.view(n, -1).to(x.dtype)


def padded(x: Tensor, n: int) -> Tensor:
    """x with zeros appended up to a multiple of n entries (n equal chunks)."""
    chunk = math.ceil(x.numel() / n)
    if x.numel() == n * chunk:
        return x
    out = torch.zeros(n * chunk, dtype=x.dtype, device=x.device)
    out[: x.numel()] = x
    return out
