"""Compression in FSDP2's gradient reductions, through its public seams:

- `set_custom_reduce_scatter`: the reduce-scatter over the shard dim (FSDP, and HSDP's shard step);
- `set_all_reduce_hook`: the all-reduce over the replicate dim (DDP, HSDP). torch runs this hook *after* its
  own replicate all-reduce when the module is on a 2-D (replicate, shard) mesh, and skips it altogether with
  `set_requires_all_reduce(False)`; on a 1-D shard mesh it runs right after the reduce-scatter, on this
  rank's shard. So with compression, DDP/HSDP shard over dp_shard_cp only and the hook all-reduces the shard
  over dp_replicate: only the shard is compressed, and its error-feedback memory stays sharded.

FSDP averages over the shard group (op AVG, or SUM when it divides itself); the hook averages over replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from lit_mesh.comm.compression import CompressionRun, CompressionSite
from lit_mesh.comm.powersgd import Segment, segments_of_shapes


def unit_segments(module: FSDPModule) -> list[Segment]:
    """The matrix of every parameter inside one rank's chunk of the unit's flat gradient buffer (FSDP2 lays
    out each parameter's dim-0 shard, padded, one after another). Read from FSDP2's parameter group (no
    public accessor); [] when a parameter is sharded on another dim (then nothing is treated as a matrix)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    fsdp_params = groups[0].fsdp_params if groups else []
    if any(fsdp_param.fsdp_placement.dim != 0 for fsdp_param in fsdp_params):
        return []
    return segments_of_shapes([fsdp_param.padded_sharded_param_size for fsdp_param in fsdp_params])


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter, sent compressed (signature of torch's ReduceScatter comm)."""

    def __init__(self, site: CompressionSite, module: FSDPModule, dim: str, final: bool) -> None:
        self.site = site
        self.module = module
        self.dim = dim
        self.final = final  # no replicate all-reduce follows

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise RuntimeError(f"compressed reduce-scatter supports SUM and AVG, FSDP asked for {op}")
        segments = unit_segments(self.module) if self.site.run.mode == "powersgd" else None
        self.site.reduce_scatter(
            output_tensor,
            input_tensor,
            group,
            average=op == dist.ReduceOp.AVG,
            dim=self.dim,
            segments=segments,
            final=self.final,
        )


class CompressedReplicaAllReduce:
    """The all-reduce hook: mean over the replicas of this rank's reduced gradient shard, compressed."""

    def __init__(self, site: CompressionSite, module: FSDPModule, group: dist.ProcessGroup, dim: str) -> None:
        self.site = site
        self.module = module
        self.group = group
        self.dim = dim

    def __call__(self, reduced_shard: torch.Tensor) -> None:
        segments = unit_segments(self.module) if self.site.run.mode == "powersgd" else None
        self.site.all_reduce(reduced_shard, self.group, average=True, dim=self.dim, segments=segments)


def fsdp_units(root: nn.Module, extra_roots: Sequence[tuple[str, nn.Module]] = ()) -> list[tuple[str, FSDPModule]]:
    """Every FSDP2 unit that reduces gradients, named by its module path under `root` ("<root>" for root), then
    those of `extra_roots` not already among them, named "<prefix>/<path>": the views of a rank's pipeline
    stages (interleaved, V schedules) are FSDP roots of their own outside the model's module tree."""
    units: list[tuple[str, FSDPModule]] = []
    seen: set[int] = set()
    for prefix, top in [("", root), *extra_roots]:
        for name, module in top.named_modules():
            if (
                id(module) in seen
                or not isinstance(module, FSDPModule)
                or not module._get_fsdp_state()._fsdp_param_groups
            ):
                continue
            seen.add(id(module))
            path = name or "<root>"
            units.append((f"{prefix}/{path}" if prefix else path, module))
    return units


def attach_gradient_compression(
    root: nn.Module,
    run: CompressionRun,
    shard_group: dist.ProcessGroup,
    replicate_group: Optional[dist.ProcessGroup],
    shard_dim: str = "dp_shard_cp",
    replicate_dim: str = "dp_replicate",
    extra_roots: Sequence[tuple[str, nn.Module]] = (),
) -> int:
    """Hook `run` into every FSDP2 unit under `root` and `extra_roots` (fsdp_units: named by module path, so
    that a resumed run finds its state). Returns the number of units hooked."""
    hooked = 0
    for unit, module in fsdp_units(root, extra_roots):
        replicated = replicate_group is not None and replicate_group.size() > 1
        if shard_group.size() > 1:
            site = run.site(f"{unit}:reduce_scatter")
            module.set_custom_reduce_scatter(CompressedReduceScatter(site, module, shard_dim, final=not replicated))
        if replicated:
            site = run.site(f"{unit}:all_reduce")
            group = cast(dist.ProcessGroup, replicate_group)  # not None: replicated
            module.set_all_reduce_hook(CompressedReplicaAllReduce(site, module, group, replicate_dim))
        hooked += 1
    return hooked
