"""Context parallelism, the attention: exact attention over a sequence split over the cp ranks — ring, Ulysses and
all-gather (see lit_mesh/parallel/context/apply.py for how they differ and how they are swapped into a model)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from lit_mesh.kernels import grouped_query_attention
from lit_mesh.parallel.context.kernels import (
    block_backward,
    block_forward,
    block_kernel_for,
    check_block_kernel,
    key_blocks_attention,
    merge_block,
    repeat_kv,
)
from lit_mesh.parallel.context.layout import ContextParallelError, _check_length, check_cp_style, is_load_balanced

# the kernels of one block, their LSE merge and the choice by device and dtype: lit_mesh/parallel/context/kernels.py


def _ring_block(step_source: int, rank: int, causal: bool, length: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal mask?) that carry work when this rank's queries meet the K/V of rank
    `step_source`, in the load-balanced layout (local = [chunk rank, chunk 2·cp-1-rank]):
      own K/V: the local causal mask (local positions increase);
      an earlier rank's: its first chunk precedes both of ours, its second follows both: all queries, half the keys;
      a later rank's: both its chunks precede our second chunk and follow our first: half the queries, all keys.
    Every rank does the same work at every step."""
    every = slice(0, length)
    if not causal:
        return every, every, False
    if step_source == rank:
        return every, every, True
    if step_source < rank:
        return every, slice(0, length // 2), False
    return slice(length // 2, length), every, False


class _RingExchange:
    """Send to the next cp rank and receive from the previous one, asynchronously (batched P2P)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, tensor: Tensor, tag: int = 0) -> tuple[list, Tensor]:
        # backward has K/V and dK/dV in flight between the same ranks: tags keep them apart where honoured (gloo)
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(pending: tuple[list, Tensor]) -> Tensor:
        requests, received = pending
        for request in requests:
            request.wait()
        return received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float, kernel: str
    ) -> Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        block_kernel = check_block_kernel(kernel)
        ring = _RingExchange(group)
        T = q.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message per step
        auxes = []  # what each block's backward op needs of its forward (CUDA kernels: RNG state, lengths)
        for step in range(cp):
            pending = ring.start(kv) if step + 1 < cp else None  # the next block travels during this one's math
            rows, cols, masked = _ring_block((rank - step) % cp, rank, causal, T)
            block_out, block_lse, aux = block_forward(
                block_kernel, q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], scale, masked
            )
            out[:, :, rows], lse[..., rows] = merge_block(out[:, :, rows], lse[..., rows], block_out, block_lse)
            auxes.append(aux)
            if pending is not None:
                kv = _RingExchange.finish(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.kernel, ctx.auxes = group, causal, scale, block_kernel, auxes
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ring = _RingExchange(group)
        T = q.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_pending = None  # the dK/dV accumulator of the block we hold, arriving from the previous rank
        for step in range(cp):
            kv_pending = ring.start(kv) if step + 1 < cp else None
            rows, cols, masked = _ring_block((rank - step) % cp, rank, causal, T)
            dq_block, dk, dv = block_backward(
                ctx.kernel,
                grad_out[:, :, rows],
                q[:, :, rows],
                kv[0, :, :, cols],
                kv[1, :, :, cols],
                out[:, :, rows],
                lse[..., rows],
                ctx.auxes[step],
                scale,
                masked,
            )
            dq[:, :, rows] += dq_block.float()
            if dkv_pending is None:
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            else:
                dkv = _RingExchange.finish(dkv_pending)
            dkv[0, :, :, cols] += dk.float()
            dkv[1, :, :, cols] += dv.float()
            # on to the next rank while the next block is computed; after the last step it arrives home
            dkv_pending = ring.start(dkv, tag=1)
            if kv_pending is not None:
                kv = _RingExchange.finish(kv_pending)
        assert dkv_pending is not None, "cp >= 1: the loop ran and sent the accumulator on"
        dkv = _RingExchange.finish(dkv_pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float, kernel: Optional[str] = None
) -> Tensor:
    """Exact attention of this rank's queries over the whole sequence; q (B, H, T/cp, D), k/v (B, H_kv, T/cp, D)
    in the load-balanced layout (for causal; any layout without a mask). K/V circulate with their own heads.
    kernel: the block kernel (kernels.BLOCK_KERNELS); None: by device and dtype."""
    return _RingAttention.apply(q, k, v, group, causal, scale, kernel or block_kernel_for(q.device, q.dtype))


# ---- Ulysses and all-gather -----------------------------------------------------------------------------


def _sequence_to_heads(tensors: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """(B, H_i, T/cp, D) sequence-sharded -> (B, H_i/cp, T, D) head-sharded (contiguous shards, rank order), all
    tensors in ONE all-to-all: each destination's heads of every tensor side by side."""
    cp = dist.get_world_size(group)
    B, _, T, D = tensors[0].shape
    heads = [t.shape[1] // cp for t in tensors]
    send = torch.cat([t.reshape(B, cp, h, T, D) for t, h in zip(tensors, heads)], dim=2)  # (B, cp: dest, sum h, T, D)
    send = send.permute(1, 2, 0, 3, 4).contiguous()  # (cp: destination, sum h, B, T, D)
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))  # (cp: source, ...)
    got = got.permute(2, 1, 0, 3, 4).reshape(B, sum(heads), cp * T, D)
    return list(got.split(heads, dim=1))


def _heads_to_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, H/cp, T, D) head-sharded -> (B, H, T/cp, D) sequence-sharded: the inverse of _sequence_to_heads."""
    cp = dist.get_world_size(group)
    B, h, T, D = x.shape
    send = x.reshape(B, h, cp, T // cp, D).permute(2, 1, 0, 3, 4).contiguous()  # (cp: destination, h, B, T/cp, D)
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))  # (cp: source = heads)
    return got.permute(2, 0, 1, 3, 4).reshape(B, cp * h, T // cp, D)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float) -> Tensor:
    """One all-to-all of q, k and v to head shards, full-sequence attention (SDPA with grouped K/V heads:
    flash/efficient kernels on GPU), all-to-all back. Contiguous sequence shards. K/V with fewer heads (GQA)
    travel as they are when cp divides their heads, else repeated just enough that it does."""
    cp = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % cp:
        choices = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ContextParallelError(
            f"cp_style='ulysses' splits the attention heads over cp: {heads} query heads on this rank (after tp) are"
            f" not divisible by cp={cp}; choose cp in {choices} (or tp so that heads / tp is), or cp_style='ring'"
        )
    if kv_heads % cp:
        kv_heads = math.lcm(kv_heads, cp)  # divides heads: heads is a multiple of both
        k, v = repeat_kv(k, kv_heads), repeat_kv(v, kv_heads)
    q, k, v = _sequence_to_heads([q, k, v], group)
    return _heads_to_sequence(grouped_query_attention(q, k, v, is_causal=causal, scale=scale), group)


def allgather_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float
) -> Tensor:
    """All-gather K/V (load-balanced layout); the local queries attend to all keys whose position is not later.

    Causal, by the block structure (no mask): rank r's first chunk (chunk r of 2·cp) sees chunks 0..r-1 whole and
    itself causally, its second (chunk 2·cp-1-r) chunks 0..2·cp-2-r whole and itself causally; the blocks merge by
    log-sum-exp (kernels.py), flash-class kernels on CUDA."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, T, D = q.shape
    kv = funcol.wait_tensor(funcol.all_gather_single_autograd(torch.stack([k, v]).contiguous(), 0, group))
    if not causal:  # any order of the keys will do
        kv = kv.reshape(cp, 2, *k.shape).permute(1, 2, 3, 0, 4, 5).reshape(2, B, k.shape[1], cp * T, D)
        return grouped_query_attention(q, kv[0], kv[1], is_causal=False, scale=scale)
    C = T // 2
    # (cp: rank, 2: k/v, B, H_kv, 2: its two chunks, C, D) -> the 2·cp chunks in sequence order
    chunks = kv.reshape(cp, 2, B, k.shape[1], 2, C, D)
    order = [chunks[c, :, :, :, 0] if c < cp else chunks[2 * cp - 1 - c, :, :, :, 1] for c in range(2 * cp)]
    kv = torch.cat(order, dim=-2)  # (2, B, H_kv, 2·cp·C, D)
    outs = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        start = chunk * C  # keys before the chunk: whole; the chunk itself: causal
        blocks = ((0, start, False), (start, start + C, True)) if start else ((start, start + C, True),)
        q_chunk = q[:, :, half * C : (half + 1) * C]
        outs.append(key_blocks_attention(q_chunk, kv[0, :, :, : start + C], kv[1, :, :, : start + C], blocks, scale))
    return torch.cat(outs, dim=2)


ATTENTION: dict[str, Callable[..., Tensor]] = {
    "ring": ring_attention,
    "ulysses": ulysses_attention,
    "allgather": allgather_attention,
}


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    style: str,
    causal: bool,
    scale: Optional[float] = None,
    ring_kernel: Optional[str] = None,
) -> Tensor:
    """Attention over the whole sequence when q, k, v (B, heads, T/cp, head_dim) hold this rank's part of it.
    `ring_kernel` (a name of kernels.BLOCK_KERNELS) picks the ring's per-block kernel; default: by device
    and dtype (kernels.KERNEL_BY_DEVICE_AND_DTYPE)."""
    check_cp_style(style)
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ContextParallelError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    _check_length(
        q.shape[2] * dist.get_world_size(group), dist.get_world_size(group), is_load_balanced(style) and causal
    )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if style == "ring":
        return ring_attention(q, k, v, group, causal, scale, ring_kernel)
    return ATTENTION[style](q, k, v, group, causal, scale)
