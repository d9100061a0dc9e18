"""Data parallelism over the mesh: FSDP (shard), DDP (replicate) and HSDP (both), all through FSDP2.

DDP is FSDP2 on a (dp_replicate, dp_shard_cp = 1) mesh: parameters stay whole, gradients are all-reduced
over dp_replicate. One engine for all three keeps TP composition and the reduction hooks uniform.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lit_mesh.comm.compression import GradientCompression
from lit_mesh.comm.fsdp import attach_gradient_compression
from lit_mesh.mesh import MeshAxis, MeshLayout, MeshViews


def data_parallel_mesh(mesh: MeshViews, layout: MeshLayout, replicate_in_hook: bool = False) -> DeviceMesh | None:
    """The mesh FSDP2 runs on: 1D (dp_shard_cp) to shard, 2D (dp_replicate, dp_shard_cp) to replicate.

    replicate_in_hook: 1D (dp_shard_cp) for DDP/HSDP too; the replicas' all-reduce is then done by a hook
    (gradient compression, lit_mesh/comm/fsdp.py).
    """
    if layout.data_parallel == "none":
        return None
    if layout.data_parallel == "fsdp" or replicate_in_hook:
        return mesh.dp_shard_cp
    return mesh.hsdp


def attach_compression(root: nn.Module, run: GradientCompression, mesh: MeshViews, layout: MeshLayout) -> None:
    """Gradient compression in every FSDP2 unit's reductions (call after fully_shard; see lit_mesh/comm)."""
    replicate = mesh.root.get_group(MeshAxis.DP_REPLICATE) if layout.dp_replicate > 1 else None
    attach_gradient_compression(root, run, mesh.dp_shard_cp.get_group(), replicate)


_COMPUTE_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    # bf16/fp16 compute from fp32 master weights; gradients reduced in fp32
    if precision in _COMPUTE_DTYPE:
        return MixedPrecisionPolicy(param_dtype=_COMPUTE_DTYPE[precision], reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_data_parallel(
    roots: Iterable[nn.Module], blocks: Iterable[nn.Module], dp_mesh: DeviceMesh, layout: MeshLayout, precision: str
) -> None:
    """fully_shard each block (the communication units), then each root for what is left (one root, or one per
    pipeline stage of this rank)."""
    policy = mixed_precision_policy(precision)
    # DDP keeps parameters gathered between forward and backward (no re-gather), like torch DDP
    reshard = layout.data_parallel != "ddp"
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def fsdp_roots(module: nn.Module) -> list[FSDPModule]:
    """The outermost FSDP modules under `module` (their settings recurse into the blocks)."""
    roots: dict[str, FSDPModule] = {}
    for name, sub in module.named_modules():  # parents come before their children
        if isinstance(sub, FSDPModule) and not any(name.startswith(f"{r}.") or not r for r in roots):
            roots[name] = sub
    return list(roots.values())


@contextmanager
def gradient_sync_off(module: Optional[nn.Module]) -> Iterator[None]:
    """Accumulating micro-batches: FSDP2 keeps gradients local, and reduces once at the last one (Lightning's
    ModelParallelStrategy reduce-scatters on every micro-batch)."""
    roots = fsdp_roots(module) if module is not None else []
    for root in roots:
        root.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)
