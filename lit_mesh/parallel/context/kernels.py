"""Context parallelism, the kernels: attention of a block of queries over a block of keys that also returns the
log-sum-exp (LSE) of each query row, its backward from the merged result, and the choice of kernel by device and
dtype. Ring and all-gather attention merge such blocks (lit_mesh/parallel/context/attention.py).

On CUDA these are the aten ops behind SDPA's flash, memory-efficient and cuDNN kernels, called the way torch's own
`context_parallel` calls them (torch/distributed/tensor/experimental/_context_parallel/_attention.py): memory O(T)
per block. torch's own cannot serve us: it dispatches only CUDA kernels, and our CPU/gloo runs need the same code.

A block: q (B, H, Tq, D), k/v (B, H_kv, Tk, D); causal: top-left aligned (a square block on the diagonal).
forward(q, k, v, scale, causal) -> (output, LSE (B, H, Tq) fp32, aux: what the backward op needs of the forward)
backward(dout, q, k, v, out, lse, aux, scale, causal) -> (dq, dk, dv), with the FINAL output and LSE of the merged
attention (flash-attention's identity: each block's gradient needs only those).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

aten = torch.ops.aten


@dataclass(frozen=True)
class BlockKernel:
    forward: Callable[..., tuple[Tensor, Tensor, Any]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    grouped_heads: bool  # takes K/V with fewer heads than q as they are (else they are repeated to q's heads)


def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor, Any]:
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse, None


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, _aux: Any, scale: float, causal: bool
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


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor, Any]:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, _aux: Any, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale
    )


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor, Any]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Any, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype).contiguous(),
        q,
        k,
        v,
        out.to(q.dtype).contiguous(),
        lse.contiguous(),
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        causal,
        seed,
        offset,
        scale=scale,
    )


def _efficient_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor, Any]:
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]], (seed, offset)  # the kernel may pad the LSE's rows


def _efficient_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Any, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = aux
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.to(q.dtype).contiguous(),
        q,
        k,
        v,
        None,
        out.to(q.dtype).contiguous(),
        lse.contiguous(),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> tuple[Tensor, Tensor, Any]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out, lse.reshape(q.shape[:-1]), (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape)


def _cudnn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Any, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = aux
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout.to(q.dtype).contiguous(),
        q,
        k,
        v,
        out.to(q.dtype).contiguous(),
        lse.reshape(lse_shape).contiguous(),
        seed,
        offset,
        None,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        causal,
        scale=scale,
    )


BLOCK_KERNELS: dict[str, BlockKernel] = {
    "math": BlockKernel(_math_forward, _math_backward, grouped_heads=False),  # materialises the scores; any device
    "cpu_flash": BlockKernel(_cpu_flash_forward, _cpu_flash_backward, grouped_heads=True),
    "flash": BlockKernel(_flash_forward, _flash_backward, grouped_heads=True),  # CUDA, fp16/bf16
    "efficient": BlockKernel(_efficient_forward, _efficient_backward, grouped_heads=False),  # CUDA, also fp32
    "cudnn": BlockKernel(_cudnn_forward, _cudnn_backward, grouped_heads=False),  # CUDA (Hopper+), fp16/bf16
}

# (device type, dtype) -> the block kernel; anything else: "math". Flash has no fp32 kernel, memory-efficient has.
KERNEL_BY_DEVICE_AND_DTYPE: dict[tuple[str, torch.dtype], str] = {
    ("cpu", torch.float32): "cpu_flash",
    ("cpu", torch.bfloat16): "cpu_flash",
    ("cpu", torch.float16): "cpu_flash",
    ("cuda", torch.bfloat16): "flash",
    ("cuda", torch.float16): "flash",
    ("cuda", torch.float32): "efficient",
}


def block_kernel_for(device: torch.device | str, dtype: torch.dtype) -> str:
    return KERNEL_BY_DEVICE_AND_DTYPE.get((torch.device(device).type, dtype), "math")


def check_block_kernel(name: str) -> BlockKernel:
    if name not in BLOCK_KERNELS:
        raise ValueError(f"ring_kernel={name!r}; choose one of {sorted(BLOCK_KERNELS)} (or None: by device and dtype)")
    return BLOCK_KERNELS[name]


def repeat_kv(k: Tensor, heads: int) -> Tensor:
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def sum_groups(grad: Tensor, kv_heads: int) -> Tensor:
    """Gradient of K/V repeated to the query heads -> of the kv heads (B, H_kv, T, D)."""
    B, H, T, D = grad.shape
    return grad.reshape(B, kv_heads, H // kv_heads, T, D).sum(2)


def block_forward(
    kernel: BlockKernel, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Any]:
    if not kernel.grouped_heads:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    return kernel.forward(q, k, v, scale, causal)


def block_backward(
    kernel: BlockKernel,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    aux: Any,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block; dk/dv with K/V's own heads."""
    kv_heads = k.shape[1]
    if not kernel.grouped_heads:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, aux, scale, causal)
    if dk.shape[1] != kv_heads:
        dk, dv = sum_groups(dk.float(), kv_heads), sum_groups(dv.float(), kv_heads)
    return dq, dk, dv


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: the running (fp32 output, LSE) and a block's, rescaled to their common LSE."""
    merged = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - merged).unsqueeze(-1)
    return out, merged


class _KeyBlocksAttention(torch.autograd.Function):
    """Queries over key blocks [start, end) of one K/V, each full or causal (a square on the diagonal), merged by
    LSE; the all-gather style's attention of one query chunk, and the ring's blocks in one process."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, blocks: tuple, scale: float, kernel_name: str) -> Tensor:
        kernel = check_block_kernel(kernel_name)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        auxes = []
        for start, end, causal in blocks:
            block_out, block_lse, aux = block_forward(kernel, q, k[:, :, start:end], v[:, :, start:end], scale, causal)
            out, lse = merge_block(out, lse, block_out, block_lse)
            auxes.append(aux)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale, ctx.kernel, ctx.auxes = blocks, scale, kernel, auxes
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
        for (start, end, causal), aux in zip(ctx.blocks, ctx.auxes):
            dq_block, dk, dv = block_backward(
                ctx.kernel, grad_out, q, k[:, :, start:end], v[:, :, start:end], out, lse, aux, ctx.scale, causal
            )
            dq += dq_block.float()
            dkv[0, :, :, start:end] += dk.float()
            dkv[1, :, :, start:end] += dv.float()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def key_blocks_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: tuple[tuple[int, int, bool], ...],
    scale: float,
    kernel: Optional[str] = None,
) -> Tensor:
    """Attention of q (B, H, Tq, D) over the key blocks ((start, end, causal), ...) of k, v (B, H_kv, Tk, D); a
    causal block must be Tq long. Kernel: by device and dtype unless named."""
    return _KeyBlocksAttention.apply(q, k, v, tuple(blocks), scale, kernel or block_kernel_for(q.device, q.dtype))


def causal_by_blocks(q: Tensor, k: Tensor, v: Tensor, n_blocks: int, kernel: Optional[str] = None) -> Tensor:
    """Causal attention over the whole sequence as the ring computes it, in one process: query chunk i meets key
    chunks 0..i-1 whole and chunk i causally, merged by LSE. For checking the kernels against SDPA."""
    T = q.shape[2]
    size = T // n_blocks
    scale = q.shape[-1] ** -0.5
    outs = []
    for i in range(n_blocks):
        blocks = tuple((j * size, (j + 1) * size, j == i) for j in range(i + 1))
        outs.append(key_blocks_attention(q[:, :, i * size : (i + 1) * size], k, v, blocks, scale, kernel))
    return torch.cat(outs, dim=2)
