"""Kernel choices by device: grouped-query attention without repeating K and V where SDPA's kernel takes grouped
heads (`enable_gqa=True`), the repeat where the kernel SDPA would pick on this device does not; AdamW's fused or
foreach implementation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.nn.functional as F


def fused_kernel_takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> bool:
    """Whether SDPA runs these inputs with `enable_gqa=True` in a fused kernel (else it would fall back to the
    math path, which repeats K/V itself and builds the T x T scores).

    CPU: the flash kernel takes grouped heads (torch 2.13, forward and backward). CUDA: flash and cuDNN take them,
    the memory-efficient kernel does not: where neither of the two applies (e.g. fp32), repeating K/V keeps the
    memory-efficient kernel."""
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, None, 0.0, is_causal, True)
    return bool(can_use_flash_attention(params, False) or can_use_cudnn_attention(params, False))


def grouped_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True, scale: Optional[float] = None
) -> torch.Tensor:
    """SDPA of q (B, H, Tq, D) over k, v (B, H_kv, Tk, D), H a multiple of H_kv (query head h reads kv head
    h // (H / H_kv)); causal by default (top-left aligned)."""
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    if fused_kernel_takes_gqa(q, k, v, is_causal):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def adamw_implementation(parameters: Iterable[torch.Tensor]) -> dict[str, bool]:
    """AdamW's keyword for its fastest path on the parameters' device: `fused=True` where torch has a fused kernel
    off the CPU (CUDA, XPU, ...: one kernel for all parameters), `foreach=True` on the CPU (multi-tensor loops;
    the numbers CPU parity runs were recorded with)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    first = next(iter(parameters), None)
    device = first.device.type if first is not None else "cpu"
    if device != "cpu" and device in _get_fused_kernels_supported_devices():
        return {"fused": True}
    return {"foreach": True}
