"""Context parallelism, the attention: exact attention over a sequence split over the cp ranks — ring, Ulysses and
all-gather (see lit_mesh/parallel/context.py for how they differ and how they are swapped into a model)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import _functional_collectives as funcol

from lit_mesh.parallel.context_layout import ContextParallelError, _check_length, check_cp_style, is_load_balanced, local_positions

# ---- attention of one block: the kernels ---------------------------------------------------------------
# q (B, H, Tq, D), k/v (B, H, Tk, D) (K/V heads already repeated to the query heads); causal: top-left aligned.
# forward -> (output, log-sum-exp per query row in fp32); backward takes the FINAL output and log-sum-exp of
# the merged attention (flash-attention's identity: each block's gradient needs only those).


def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    dout = dout.float()
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    ds = p * (torch.matmul(dout, v.float().transpose(-1, -2)) - (dout * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, dk, torch.matmul(p.transpose(-1, -2), dout)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale
    )


# "math" materialises the block's scores (any device); "cpu_flash" is torch's fused CPU kernel (memory O(T))
BLOCK_KERNELS = {"math": (_math_forward, _math_backward), "cpu_flash": (_cpu_flash_forward, _cpu_flash_backward)}


def _default_kernel(device: torch.device) -> str:
    return "cpu_flash" if device.type == "cpu" else "math"


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


def _sum_groups(grad: Tensor, kv_heads: int) -> Tensor:
    """Gradient of K/V repeated to the query heads -> of the kv heads (B, H_kv, T, D)."""
    B, H, T, D = grad.shape
    return grad.reshape(B, kv_heads, H // kv_heads, T, D).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float, kernel: str
    ) -> Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        block_forward = BLOCK_KERNELS[kernel][0]
        ring = _RingExchange(group)
        heads, T = q.shape[1], q.shape[2]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message per step
        for step in range(cp):
            pending = ring.start(kv) if step + 1 < cp else None  # the next block travels during this one's math
            rows, cols, masked = _ring_block((rank - step) % cp, rank, causal, T)
            kb, vb = (_repeat_kv(t[:, :, cols], heads) for t in kv)
            block_out, block_lse = block_forward(q[:, :, rows], kb, vb, scale, masked)
            # online softmax: rescale the running result and the block's to their common log-sum-exp
            merged = torch.logaddexp(lse[..., rows], block_lse)
            out[:, :, rows] = (
                out[:, :, rows] * torch.exp(lse[..., rows] - merged).unsqueeze(-1)
                + block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1)
            )
            lse[..., rows] = merged
            if pending is not None:
                kv = _RingExchange.finish(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.kernel = group, causal, scale, kernel
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        block_backward = BLOCK_KERNELS[ctx.kernel][1]
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        ring = _RingExchange(group)
        heads, T, kv_heads = q.shape[1], q.shape[2], k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_pending = None  # the dK/dV accumulator of the block we hold, arriving from the previous rank
        for step in range(cp):
            kv_pending = ring.start(kv) if step + 1 < cp else None
            rows, cols, masked = _ring_block((rank - step) % cp, rank, causal, T)
            kb, vb = (_repeat_kv(t[:, :, cols], heads) for t in kv)
            dq_block, dk, dv = block_backward(
                grad_out[:, :, rows], q[:, :, rows], kb, vb, out[:, :, rows], lse[..., rows], scale, masked
            )
            dq[:, :, rows] += dq_block.float()
            if dkv_pending is None:
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            else:
                dkv = _RingExchange.finish(dkv_pending)
            dkv[0, :, :, cols] += _sum_groups(dk.float(), kv_heads)
            dkv[1, :, :, cols] += _sum_groups(dv.float(), kv_heads)
            # on to the next rank while the next block is computed; after the last step it arrives home
            dkv_pending = ring.start(dkv, tag=1)
            if kv_pending is not None:
                kv = _RingExchange.finish(kv_pending)
        dkv = _RingExchange.finish(dkv_pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float, kernel: Optional[str] = None
) -> Tensor:
    """Exact attention of this rank's queries over the whole sequence; q (B, H, T/cp, D), k/v (B, H_kv, T/cp, D)
    in the load-balanced layout (for causal; any layout without a mask). K/V circulate with their own heads."""
    return _RingAttention.apply(q, k, v, group, causal, scale, kernel or _default_kernel(q.device))


# ---- Ulysses and all-gather -----------------------------------------------------------------------------


def _sequence_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, H, T/cp, D) sequence-sharded -> (B, H/cp, T, D) head-sharded (contiguous shards, rank order)."""
    cp = dist.get_world_size(group)
    B, H, T, D = x.shape
    send = x.reshape(B, cp, H // cp, T, D).permute(1, 2, 0, 3, 4).contiguous()  # (cp: destination, H/cp, B, T, D)
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))  # (cp: source, ...)
    return got.permute(2, 1, 0, 3, 4).reshape(B, H // cp, cp * T, D)


def _heads_to_sequence(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(B, H/cp, T, D) head-sharded -> (B, H, T/cp, D) sequence-sharded: the inverse of _sequence_to_heads."""
    cp = dist.get_world_size(group)
    B, h, T, D = x.shape
    send = x.reshape(B, h, cp, T // cp, D).permute(2, 1, 0, 3, 4).contiguous()  # (cp: destination, h, B, T/cp, D)
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))  # (cp: source = heads)
    return got.permute(2, 0, 1, 3, 4).reshape(B, cp * h, T // cp, D)


def _repeat_kv(k: Tensor, heads: int) -> Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float) -> Tensor:
    """All-to-all to head shards, full-sequence attention (SDPA: flash/efficient kernels on GPU), all-to-all back.
    Contiguous sequence shards. K/V with fewer heads (GQA) travel as they are when cp divides their heads, else
    repeated just enough that it does."""
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
        k, v = _repeat_kv(k, kv_heads), _repeat_kv(v, kv_heads)
    q, k, v = (_sequence_to_heads(t, group) for t in (q, k, v))
    local_heads = q.shape[1]
    k, v = _repeat_kv(k, local_heads), _repeat_kv(v, local_heads)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return _heads_to_sequence(out, group)


def allgather_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, causal: bool, scale: float) -> Tensor:
    """All-gather K/V (load-balanced layout), local queries attend to all keys whose position is not later."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    B, H, T, D = q.shape
    kv = funcol.wait_tensor(funcol.all_gather_single_autograd(torch.stack([k, v]).contiguous(), 0, group))
    kv = kv.reshape(cp, 2, *k.shape).permute(1, 2, 3, 0, 4, 5).reshape(2, B, k.shape[1], cp * T, D)
    mask = None
    if causal:
        mine = local_positions(T, cp, rank, True, q.device)
        everyone = torch.cat([local_positions(T, cp, r, True, q.device) for r in range(cp)])
        mask = mine[:, None] >= everyone[None, :]
    return F.scaled_dot_product_attention(q, _repeat_kv(kv[0], H), _repeat_kv(kv[1], H), attn_mask=mask, scale=scale)


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
    `ring_kernel` ("math" or "cpu_flash") picks the ring's per-block kernel; default by device."""
    check_cp_style(style)
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ContextParallelError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}")
    _check_length(q.shape[2] * dist.get_world_size(group), dist.get_world_size(group), is_load_balanced(style) and causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if style == "ring":
        return ring_attention(q, k, v, group, causal, scale, ring_kernel)
    return ATTENTION[style](q, k, v, group, causal, scale)
