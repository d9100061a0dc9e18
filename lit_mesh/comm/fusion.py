"""Tensor fusion: many small tensors packed into a few buckets, one collective per bucket.

Greedy and in order (every rank must form the same buckets): a bucket takes tensors until the next one
would pass the size cap; a tensor larger than the cap goes alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def plan_buckets(numels: Sequence[int], itemsize: int, cap_bytes: int) -> list[list[int]]:
    """Indices of the tensors in each bucket."""
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        if buckets and size + n * itemsize <= cap_bytes:
            buckets[-1].append(i)
            size += n * itemsize
        else:
            buckets.append([i])
            size = n * itemsize
    return buckets


def fused(tensors: Sequence[Tensor], cap_bytes: int, collective: Callable[[Tensor], None]) -> None:
    """Run the in-place `collective` over `tensors` packed into buckets; results are copied back in place."""
    if not tensors:
        return
    for bucket in plan_buckets([t.numel() for t in tensors], tensors[0].element_size(), cap_bytes):
        members = [tensors[i] for i in bucket]
        flat = torch.cat([t.reshape(-1) for t in members])
        collective(flat)
        offset = 0
        for t in members:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
