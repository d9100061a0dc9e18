"""Context-parallel attention against full single-device attention, forward and backward (fp32).

Usage: torchrun --standalone --nproc_per_node=4 tests/workers/cp_attention.py OUT_JSON
Every rank draws the same whole q, k, v and output gradient, computes the reference with torch's SDPA, then
runs its shard through context_parallel_attention on a cp group of 2 (two groups side by side) and of 4.
Rank 0 writes {case: max abs error over ranks of out / dq / dk / dv} and the messages of the refused inputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lit_mesh.parallel.context import (
    CP_STYLES,
    context_parallel_attention,
    gather_batch,
    is_load_balanced,
    shard_batch,
    shard_sequence,
)
from tests.workers import exit_skipping_teardown

B, HEADS, D = 2, 8, 8
SEQ_DIM = 2  # (B, heads, T, D)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, causal: bool
) -> list[torch.Tensor]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


def compare(
    cp_mesh, style: str, causal: bool, kv_heads: int, length: int, ring_kernel: str | None = None
) -> list[float]:
    gen = torch.Generator().manual_seed(length * 100 + kv_heads)
    q = torch.randn(B, HEADS, length, D, generator=gen)
    k, v = (torch.randn(B, kv_heads, length, D, generator=gen) for _ in range(2))
    grad = torch.randn(B, HEADS, length, D, generator=gen)
    expected = reference(q, k, v, grad, causal)
    cp, rank, balanced = cp_mesh.size(), cp_mesh.get_local_rank(), is_load_balanced(style) and causal

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, cp, rank, balanced, dim=SEQ_DIM)

    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, cp_mesh.get_group(), style, causal, ring_kernel=ring_kernel)
    out.backward(shard(grad))
    errors = torch.tensor(
        [
            (got - shard(want)).abs().max().item()
            for got, want in zip([out.detach(), ql.grad, kl.grad, vl.grad], expected)
        ]
    )
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    return errors.tolist()


def refused(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    meshes = {
        2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("other", "cp"))["cp"],
        4: init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))["cp"],
    }
    results: dict[str, object] = {}
    for cp, mesh in meshes.items():
        for style in CP_STYLES:
            for causal in (True, False):
                for kv_heads in (HEADS, 2):  # multi-head and grouped-query (4 query heads per kv head)
                    name = f"cp{cp}-{style}-{'causal' if causal else 'full'}-kv{kv_heads}"
                    results[name] = compare(mesh, style, causal, kv_heads, length=32)
                    if style == "ring":  # the default on CPU is torch's fused kernel; the plain math serves GPUs
                        results[f"{name}-math"] = compare(mesh, style, causal, kv_heads, length=32, ring_kernel="math")
    group4 = meshes[4].get_group()
    x = torch.zeros(1, 6, 8, 4)
    results["ulysses_heads"] = refused(lambda: context_parallel_attention(x, x, x, group4, "ulysses", True))
    y = torch.zeros(1, 8, 3, 4)  # 3 tokens per rank: 12 in all, not a multiple of 2 x 4 = 8
    results["ring_length"] = refused(lambda: context_parallel_attention(y, y, y, group4, "ring", True))
    for style in CP_STYLES:  # predictions: every cp rank gets the whole sequence back, in token order
        whole = (
            torch.arange(2 * 16).view(2, 16),
            {"logits": torch.randn(2, 16, 3, generator=torch.Generator().manual_seed(1))},
        )
        back = gather_batch(shard_batch(whole, meshes[4], style), meshes[4], style)
        results[f"gather_{style}"] = torch.equal(back[0], whole[0]) and torch.equal(
            back[1]["logits"], whole[1]["logits"]
        )
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    exit_skipping_teardown()
