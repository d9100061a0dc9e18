"""Context parallelism: the sequence of every sample split over the cp ranks, attention exact across the split.

torch's experimental `context_parallel` only dispatches to CUDA attention kernels, so the three styles are ours
and run on any backend (gloo/CPU, NCCL/GPU):

  ring       K/V blocks circulate around the cp group (P2P, the next block in flight while the current one is
             computed); partial results merge by log-sum-exp (online softmax). Backward circulates K/V again,
             each block travelling with its dK/dV accumulator, which arrives home after a full turn.
  ulysses    all-to-all from sequence-sharded to head-sharded, ordinary attention on H/cp heads over the whole
             sequence, all-to-all back. Grouped-query K/V travel with their own (fewer) heads, repeated only as
             far as cp must divide them.
  allgather  all-gather K/V; the local queries attend to the whole sequence (backward: reduce-scatter dK/dV).

Layout of the sequence. Ring and allgather balance causal work: the sequence is cut into 2·cp chunks and cp rank i
holds chunks i and 2·cp-1-i (an early and a late one), so every rank does the same work. Ulysses computes the
whole sequence per head, so it keeps contiguous shards (rank i holds chunk i of cp).

How it is applied: the plan names the module whose forward calls `F.scaled_dot_product_attention` and the
keyword of the model's forward that takes token positions. A TorchFunctionMode, active only inside that module,
sends the call to the style's function; a forward pre-hook passes each rank's global positions (for RoPE). The
strategy shards every batch along the sequence with `shard_batch`, in the same order. Models keep no CP code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from lit_mesh.mesh import MeshConfigError
from lit_mesh.parallel.tensor import PlanError
from lit_mesh.plan import ParallelPlan

CPStyle = Literal["ring", "ulysses", "allgather"]
CP_STYLES: tuple[str, ...] = CPStyle.__args__  # type: ignore[attr-defined]
SEQUENCE_DIM = 1  # batches and activations are (batch, sequence, ...)


class ContextParallelError(PlanError):
    """Input that context parallelism cannot split exactly, with the numbers and the fix."""


def check_cp_style(style: str) -> None:
    if style not in CP_STYLES:
        raise MeshConfigError(f"cp_style={style!r}; choose one of {CP_STYLES}")


def is_load_balanced(style: str) -> bool:
    """Ring and allgather hold chunks i and 2·cp-1-i (equal causal work); Ulysses contiguous shards."""
    return style != "ulysses"


# ---- the layout of the sequence over the cp ranks -------------------------------------------------------


def _check_length(length: int, cp: int, load_balanced: bool) -> None:
    parts = 2 * cp if load_balanced else cp
    if length % parts:
        how = (
            f"2 x cp = {parts} chunks (load-balanced causal layout: rank i holds chunks i and 2·cp-1-i)"
            if load_balanced
            else f"cp = {parts} shards"
        )
        raise ContextParallelError(
            f"context parallel cuts the sequence into {how}, but the sequence length is {length}; use a sequence"
            f" length that is a multiple of {parts}"
        )


def local_chunks(cp: int, rank: int, load_balanced: bool) -> list[int]:
    """Indices of the chunks rank `rank` holds: of 2·cp chunks (load-balanced) or of cp."""
    return [rank, 2 * cp - 1 - rank] if load_balanced else [rank]


def shard_sequence(x: Tensor, cp: int, rank: int, load_balanced: bool, dim: int = SEQUENCE_DIM) -> Tensor:
    """This rank's part of `x` along `dim` (the whole sequence on every rank before)."""
    _check_length(x.shape[dim], cp, load_balanced)
    chunks = x.chunk(2 * cp if load_balanced else cp, dim=dim)
    return torch.cat([chunks[i] for i in local_chunks(cp, rank, load_balanced)], dim=dim)


def unshard_sequence(shards: list[Tensor], load_balanced: bool, dim: int = SEQUENCE_DIM) -> Tensor:
    """The whole sequence back from every rank's shard (rank order): the inverse of shard_sequence."""
    cp = len(shards)
    if not load_balanced:
        return torch.cat(shards, dim=dim)
    chunks: list[Optional[Tensor]] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def local_positions(local_length: int, cp: int, rank: int, load_balanced: bool, device: Any = None) -> Tensor:
    """Global positions (local_length,) of the tokens this rank holds."""
    whole = torch.arange(local_length * cp, device=device)
    return shard_sequence(whole, cp, rank, load_balanced, dim=0)


def shard_batch(batch: Any, cp_mesh: DeviceMesh, style: str) -> Any:
    """Every tensor of a batch with a sequence dim (ndim >= 2: inputs, targets, masks) -> this cp rank's part."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    cp, rank, balanced = cp_mesh.size(), cp_mesh.get_local_rank(), is_load_balanced(style)

    def shard(x: Tensor) -> Tensor:
        return shard_sequence(x, cp, rank, balanced) if x.dim() >= 2 else x

    return apply_to_collection(batch, Tensor, shard)


def gather_batch(output: Any, cp_mesh: DeviceMesh, style: str) -> Any:
    """The whole sequence back on every cp rank, in token order, for every tensor with a sequence dim (ndim >= 2):
    what predict returns is then the same as on one device."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    cp, balanced = cp_mesh.size(), is_load_balanced(style)

    def gather(x: Tensor) -> Tensor:
        if x.dim() < 2:
            return x
        parts = funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, cp_mesh.get_group()))
        return unshard_sequence(list(parts.chunk(cp, dim=0)), balanced)

    return apply_to_collection(output, Tensor, gather)


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


# ---- swapping it into a model ----------------------------------------------------------------------------


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    found = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    found.update(zip(names, args))
    found.update(kwargs)
    return found


class ContextParallelAttention(TorchFunctionMode):
    """Active inside the attention module: its F.scaled_dot_product_attention call becomes the cp style's."""

    def __init__(self, group: dist.ProcessGroup, style: str, where: str) -> None:
        super().__init__()
        self.group, self.style, self.where = group, style, where
        self.calls = 0  # attention calls redirected during the current forward

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        a = _sdpa_arguments(args, kwargs)
        if a["attn_mask"] is not None:
            raise ContextParallelError(
                f"{self.where} passes attn_mask to scaled_dot_product_attention; context parallel supports"
                " is_causal=True or no mask; express the mask with is_causal, or use cp=1"
            )
        if a["dropout_p"]:
            raise ContextParallelError(f"{self.where} uses attention dropout_p={a['dropout_p']}; context parallel needs 0")
        q, k, v = a["query"], a["key"], a["value"]
        self.calls += 1
        return context_parallel_attention(q, k, v, self.group, self.style, a["is_causal"], a["scale"])


def _swap_attention(module: nn.Module, mode: ContextParallelAttention) -> None:
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        mode.calls = 0
        with mode:
            out = original(*args, **kwargs)
        if mode.calls == 0:  # attention computed some other way would silently see only this rank's shard
            raise ContextParallelError(
                f"{mode.where} ran without calling F.scaled_dot_product_attention, so context parallel cannot make"
                " its attention span the cp ranks; compute attention with F.scaled_dot_product_attention, or use cp=1"
            )
        return out

    module.forward = forward  # type: ignore[method-assign]


def _positions_hook(keyword: str, cp: int, rank: int, load_balanced: bool) -> Callable:
    def pass_positions(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get(keyword) is None:
            local_length = args[0].shape[SEQUENCE_DIM]
            kwargs = {**kwargs, keyword: local_positions(local_length, cp, rank, load_balanced, args[0].device)}
        return args, kwargs

    return pass_positions


def refuse_cp_without_plan(cp: int, module_name: str) -> None:
    """The strategy shards batches over cp; without a plan applied, attention would see only its shard."""
    if cp > 1:
        raise PlanError(
            f"cp={cp} but configure_model of {module_name} parallelised the model itself, so MeshStrategy applies no"
            " plan and cannot make its attention span the cp ranks (it would see only its shard of the sequence);"
            " use cp=1, or leave parallelisation to a parallel_plan() that declares attention and positions"
        )


def apply_context_parallel(model: nn.Module, plan: ParallelPlan, cp_mesh: DeviceMesh, style: str) -> None:
    """Swap the attention of every block for the cp style's and pass this rank's global positions to `model`."""
    check_cp_style(style)
    name = type(model).__name__
    if not plan.attention:
        raise PlanError(
            f"cp={cp_mesh.size()} but {name}.parallel_plan() declares no attention module (ParallelPlan.attention);"
            f" context parallel swaps the attention a plan names: declare it, or use cp=1"
        )
    if not plan.positions:
        raise PlanError(
            f"cp={cp_mesh.size()} but {name}.parallel_plan() declares no positions keyword (ParallelPlan.positions):"
            " each rank holds tokens from all over the sequence and the model must be told their global positions;"
            " declare the keyword of forward() that takes them, or use cp=1"
        )
    group, rank = cp_mesh.get_group(), cp_mesh.get_local_rank()
    for index, block in enumerate(model.get_submodule(plan.blocks)):
        where = f"{name}.{plan.blocks}.{index}.{plan.attention}"
        try:
            attention = block.get_submodule(plan.attention)
        except AttributeError:
            raise PlanError(f"{name}.parallel_plan() names attention {plan.attention!r}, which {where} does not have")
        _swap_attention(attention, ContextParallelAttention(group, style, where))
    model.register_forward_pre_hook(
        _positions_hook(plan.positions, cp_mesh.size(), rank, is_load_balanced(style)), with_kwargs=True
    )
