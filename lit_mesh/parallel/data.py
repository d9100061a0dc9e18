"""Data parallelism over the mesh: FSDP (shard), DDP (replicate) and HSDP (both), all through FSDP2.

DDP is FSDP2 on a (dp_replicate, dp_shard_cp = 1) mesh: parameters stay whole, gradients are all-reduced
over dp_replicate. One engine for all three keeps TP composition and the reduction hooks uniform.

ZeRO stages are options of the sharded dim (zero_stage), all on FSDP2, so that TP's DTensors, Lightning's optimizer,
DCP state dicts and global-norm clipping work unchanged on every stage (torch's ZeroRedundancyOptimizer partitions
whole parameters unevenly, cannot broadcast DTensors, and keeps a state dict DCP cannot read):
- stage 3: FSDP2 `fully_shard(reshard_after_forward=True)`: parameters gathered in forward and again in backward;
- stage 2: `reshard_after_forward=False`: parameters gathered once per step (kept over accumulated micro-batches)
  and freed when backward ends; gradients reduce-scattered every micro-batch; optimizer state and update sharded;
- stage 1: as stage 2, but gradients accumulate whole on each rank and are reduced once, at the last micro-batch
  (a reduce-scatter: the half of the all-reduce the sharded update needs; the other half is the next all-gather).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lit_mesh.comm.compression import CompressionRun
from lit_mesh.comm.fsdp import attach_gradient_compression
from lit_mesh.errors import MeshConfigError
from lit_mesh.mesh import MeshAxis, MeshLayout, MeshViews
from lit_mesh.unit import Rule, option


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


def attach_compression(
    root: nn.Module,
    run: CompressionRun,
    mesh: MeshViews,
    layout: MeshLayout,
    extra_roots: Sequence[tuple[str, nn.Module]] = (),
) -> None:
    """Gradient compression in every FSDP2 unit's reductions (call after fully_shard; see lit_mesh/comm);
    `extra_roots`: the views of this rank's pipeline stages, FSDP roots outside the model's tree."""
    replicate = mesh.root.get_group(MeshAxis.DP_REPLICATE) if layout.dp_replicate > 1 else None
    attach_gradient_compression(root, run, mesh.dp_shard_cp.get_group(), replicate, extra_roots=extra_roots)


_COMPUTE_DTYPE = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    # bf16/fp16 compute from fp32 master weights; gradients reduced in fp32
    if precision in _COMPUTE_DTYPE:
        return MixedPrecisionPolicy(param_dtype=_COMPUTE_DTYPE[precision], reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


ZeroStage = Literal[1, 2, 3]
ZERO_STAGES = (1, 2, 3)


def check_zero_stage(zero_stage: object) -> None:
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise MeshConfigError(
            f"zero_stage={zero_stage!r} must be 1 (sharded optimizer state), 2 (and sharded gradients) or 3 (and"
            " sharded parameters: FSDP, the default)"
        )


@dataclass(frozen=True)
class DataParallelOptions:
    zero_stage: ZeroStage = option(
        3,
        doc="what the sharded data-parallel dim (dp / dp_shard) shards: 3 (FSDP: parameters, gradients and optimizer"
        " state), 2 (gradients and optimizer state: parameters gathered once per step, kept until backward ends) or 1"
        " (optimizer state: gradients also reduced once per step, at the last accumulated micro-batch). Lower stages"
        " communicate less and hold more. See lit_mesh/parallel/data.py.",
    )

    def __post_init__(self) -> None:
        check_zero_stage(self.zero_stage)


RULES: list[Rule] = [
    Rule(
        # torch's PipelineStage keeps FSDP units gathered over the micro-batches and reduces once at the last one
        "zero_stage_with_pp",
        "init",
        lambda f: f.options.data.zero_stage != 3 and f.degrees["pp"] > 1,
        lambda f: (
            f"zero_stage={f.options.data.zero_stage} with pp={f.degrees['pp']}: under a pipeline each stage's"
            " parameters are already gathered once per step and its gradients reduced once, at the last micro-batch"
            " (torch's PipelineStage), with parameters, gradients and optimizer state sharded between steps; zero_stage"
            " applies to pp=1 only: leave it at 3 with pp, or use pp=1"
        ),
    ),
    Rule(
        "zero_stage_needs_sharded_dp",
        "launch",
        lambda f: f.options.data.zero_stage != 3 and f.layout.data_parallel in ("none", "ddp"),
        lambda f: (
            f"zero_stage={f.options.data.zero_stage} shards optimizer state"
            f"{' and gradients' if f.options.data.zero_stage == 2 else ''} over the sharded data-parallel dim, but the"
            f" mesh has none ({f.layout.describe()}): "
            + (
                "dp_replicate alone keeps everything whole (DDP, ZeRO stage 0); "
                if f.layout.data_parallel == "ddp"
                else "one data-parallel rank has nothing to shard; "
            )
            + "give dp (or dp_shard) > 1, or leave zero_stage=3"
        ),
    ),
    Rule(
        "self_parallelised_without_zero_stage",
        "setup",
        lambda f: f.self_parallelised and f.options.data.zero_stage != 3,
        lambda f: (
            f"zero_stage={f.options.data.zero_stage} chooses how MeshStrategy applies FSDP2, but configure_model"
            f" of {f.model_name} parallelised the model itself; pass reshard_after_forward=False to your fully_shard"
            " calls (ZeRO-2), or let MeshStrategy apply a parallel_plan()"
        ),
    ),
]


def reshards_after_forward(layout: MeshLayout, zero_stage: int) -> bool:
    """Whether FSDP2 units (blocks, experts) free their gathered parameters after forward: ZeRO-3 only; never
    under DDP (nothing is sharded) or a pipeline (the stage's micro-batches reuse them)."""
    return zero_stage == 3 and layout.data_parallel != "ddp" and layout.pp == 1


def apply_data_parallel(
    roots: Iterable[nn.Module],
    blocks: Iterable[nn.Module],
    dp_mesh: DeviceMesh,
    layout: MeshLayout,
    precision: str,
    zero_stage: int = 3,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
) -> None:
    """fully_shard each block (the communication units), then each root for what is left (one root, or one per
    pipeline stage of this rank).

    Resharding after forward (torchtitan's choices): a unit whose parameters backward needs next keeps them
    gathered — the last block and the roots (embeddings, final norm, head: backward starts there), and every unit
    under a pipeline (the stage's micro-batches reuse them: one all-gather per step; the schedule reshards after
    the last backward). DDP keeps everything gathered, like torch DDP; so do ZeRO stages 1 and 2.
    """
    policy = mp_policy or mixed_precision_policy(precision)  # mp_policy: FSDPStrategy's mixed_precision
    placement = offload or OffloadPolicy()  # FSDPStrategy's cpu_offload: CPUOffloadPolicy
    reshard = reshards_after_forward(layout, zero_stage)
    blocks = list(blocks)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(
            block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard and not last, offload_policy=placement
        )
    for root in roots:
        fully_shard(root, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False, offload_policy=placement)


@contextmanager
def defer_gradient_reduction(
    module: nn.Module | None, keep_sharded: bool = True, keep_gathered: bool = False
) -> Iterator[None]:
    """Accumulating micro-batches: reduce once, at the last one.

    keep_sharded (FSDP, HSDP: dp_shard x cp > 1): gradients are reduce-scattered every micro-batch and stay sharded (1/N of the
    bytes between micro-batches); only HSDP's replicate all-reduce waits for the last micro-batch (FSDP2's
    set_requires_all_reduce). Otherwise (DDP, ZeRO-1, or compression hooks that own the reduction): no reduction
    until the last micro-batch, with full gradients kept in between (set_requires_gradient_sync).
    keep_gathered (ZeRO-1/2): parameters stay gathered until the last micro-batch's backward (one all-gather per
    step; no optimizer step runs in between, so they cannot go stale).
    """
    roots = fsdp_roots(module) if module is not None else []
    for root in roots:
        root.set_requires_all_reduce(False) if keep_sharded else root.set_requires_gradient_sync(False)
        if keep_gathered:
            root.set_reshard_after_backward(False)
    try:
        yield
    finally:
        for root in roots:
            root.set_requires_all_reduce(True) if keep_sharded else root.set_requires_gradient_sync(True)
            if keep_gathered:
                root.set_reshard_after_backward(True)


def refuse_fsdp1(root: nn.Module, strategy: str) -> None:
    """Modules wrapped with the FSDP1 class cannot join a DTensor mesh: name them, say what to use instead."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = [m for m in root.modules() if isinstance(m, FullyShardedDataParallel)]
    if wrapped:
        names = {id(m): name for name, m in root.named_modules()}
        found = [names.get(id(m)) or type(m).__name__ for m in wrapped]
        raise TypeError(
            f"Found modules that are wrapped with `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1): {found}."
            f" The `{strategy}` only supports the new FSDP2 APIs in PyTorch >= 2.4: apply"
            " `torch.distributed.fsdp.fully_shard` in configure_model, or declare a parallel_plan() and let"
            f" {strategy} shard the model"
        )


def fsdp_roots(module: nn.Module) -> list[FSDPModule]:
    """The outermost FSDP modules under `module` (their settings recurse into the blocks)."""
    roots: dict[str, FSDPModule] = {}
    for name, sub in module.named_modules():  # parents come before their children
        if isinstance(sub, FSDPModule) and not any(name.startswith(f"{r}.") or not r for r in roots):
            roots[name] = sub
    return list(roots.values())
