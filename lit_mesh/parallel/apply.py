"""The one place where plans are applied, in the one order:
MoE layer adapters -> split into pipeline stages -> TP/SP -> CP -> EP -> activation checkpointing ->
torch.compile -> FSDP/HSDP/DDP per block (experts first) -> each stage's root -> communication hooks.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_mesh.comm.compression import GradientCompression
from lit_mesh.comm.hierarchical import Hierarchy, attach_hierarchical_all_reduce
from lit_mesh.hf import declared_plan as transformers_plan
from lit_mesh.hf.init import initialise_weights as initialise_transformers_weights
from lit_mesh.init import init_parameters
from lit_mesh.mesh import MeshLayout, MeshViews
from lit_mesh.parallel.checkpointing import apply_activation_checkpointing
from lit_mesh.parallel.compile import apply_compile
from lit_mesh.parallel.context import apply_context_parallel
from lit_mesh.parallel.data import apply_data_parallel, attach_compression, data_parallel_mesh
from lit_mesh.parallel.expert import adapt_moe_layers, apply_expert_parallel, expert_modules, shard_experts
from lit_mesh.parallel.pipeline import PipelineSettings
from lit_mesh.parallel.pipeline_split import (
    Stage,
    balanced_split,
    check_split,
    pass_global_positions,
    split_into_stages,
    stage_ranks,
)
from lit_mesh.parallel.tensor import PlanError, apply_tensor_parallel, retie, tied_parameters
from lit_mesh.plan import ParallelPlan


@dataclass
class PlanOwner:
    """A module that declared `parallel_plan()`, with its name inside the LightningModule."""

    name: str
    module: nn.Module
    plan: ParallelPlan


def find_plan_owners(root: nn.Module) -> list[PlanOwner]:
    """The outermost modules under `root` (root excluded) that declare a ParallelPlan."""
    owners: list[PlanOwner] = []
    for name, module in root.named_modules():
        if not name or any(name.startswith(f"{o.name}.") for o in owners):
            continue
        declare = getattr(module, "parallel_plan", None)
        if not callable(declare):
            declare = transformers_plan(module)  # a transformers model: its registered or derived plan
        if callable(declare):
            plan = declare()
            if not isinstance(plan, ParallelPlan):
                raise PlanError(f"{type(module).__name__}.parallel_plan() returned {type(plan).__name__}, not a ParallelPlan")
            owners.append(PlanOwner(name, module, plan))
    return owners


def is_user_parallelised(root: nn.Module) -> bool:
    """True when configure_model already applied parallelism itself (FSDP2 modules or DTensor parameters)."""
    return any(isinstance(m, FSDPModule) for m in root.modules()) or any(
        isinstance(p, DTensor) for p in root.parameters()
    )


def _units_outside_owners(module: nn.Module, prefix: str, owners: list[PlanOwner]) -> list[nn.Module]:
    """Top-most submodules with parameters that hold no plan owner: the FSDP units for everything else.

    The LightningModule itself (prefix "") is never a unit: FSDP2 would change its class under Lightning.
    """
    if any(o.name == prefix for o in owners):
        return []
    holds_owner = any(o.name.startswith(f"{prefix}.") for o in owners) if prefix else True
    if not holds_owner:
        return [module] if any(True for _ in module.parameters()) else []
    direct = [n for n, _ in module.named_parameters(recurse=False)]
    if direct:
        raise PlanError(
            f"{type(module).__name__} holds parameters {direct} directly; move them into a submodule"
            " (an nn.Module attribute) so that they can be sharded"
        )
    units: list[nn.Module] = []
    for child_name, child in module.named_children():
        units += _units_outside_owners(child, f"{prefix}.{child_name}" if prefix else child_name, owners)
    return units


@dataclass
class Parallelized:
    """What `parallelize` did: the plan owners, and this rank's pipeline stages (None without pp)."""

    owners: list[PlanOwner]
    stages: list[Stage] | None = None
    stage_ranks: list[int] | None = None


def split_pipeline(root: nn.Module, owners: list[PlanOwner], mesh: MeshViews, pipeline: PipelineSettings) -> Parallelized:
    """Cut the one plan owner into stages and keep this pp rank's (the first step of the order)."""
    if len(owners) != 1:
        found = [o.name for o in owners] or "none"
        raise PlanError(
            f"pp > 1 pipelines one model that declares parallel_plan(); {type(root).__name__} has {found}."
            " Declare a plan on the network (see examples/own_model_plan.py), or use pp=1"
        )
    owner = owners[0]
    if owner.plan.moe_layer:  # the MoE layers' auxiliary losses would have to travel between stages
        raise PlanError(
            f"pp={mesh['pp'].size()} with the MoE model {type(owner.module).__name__}: pipeline stages do not carry"
            " the auxiliary load-balancing loss between them yet; use pp=1 (ep, dp, tp and cp work with MoE)"
        )
    n_blocks = len(owner.module.get_submodule(owner.plan.blocks))
    pp = mesh["pp"].size()
    n_stages = pp * pipeline.local_stages()
    split = check_split(pipeline.split, n_blocks, n_stages) if pipeline.split else balanced_split(n_blocks, n_stages)
    ranks = stage_ranks(n_stages, pp, pipeline.placement)
    stages = split_into_stages(owner.module, owner.plan, split, ranks, mesh["pp"].get_local_rank())
    return Parallelized(owners, stages, ranks)


def parallelize(
    root: nn.Module,
    mesh: MeshViews,
    layout: MeshLayout,
    *,
    sequence_parallel: bool,
    precision: str,
    activation_checkpointing: str = "none",
    ac_every_n_blocks: int = 1,
    compile_backend: str | None = None,
    pipeline: PipelineSettings | None = None,
    cp_style: str = "ring",
    grad_compression: GradientCompression | None = None,
    replicate_hierarchy: Hierarchy | None = None,
) -> Parallelized:
    """Apply every technique to `root` (the LightningModule) in the fixed order."""
    owners = find_plan_owners(root)
    for owner in owners:
        adapt_moe_layers(owner.module, owner.plan)
    done = split_pipeline(root, owners, mesh, pipeline) if layout.pp > 1 and pipeline else Parallelized(owners)
    per_block = {"activation_checkpointing": activation_checkpointing != "none", "compile_blocks": compile_backend}
    for option, asked in per_block.items():
        if asked and not owners:
            raise PlanError(
                f"{option} acts on the blocks a parallel_plan() names, but no module of {type(root).__name__}"
                " declares one; declare one (see examples/own_model_plan.py)"
            )
    if layout.tp > 1:
        if not owners:
            raise PlanError(
                f"tp={layout.tp} but no module of {type(root).__name__} declares parallel_plan(); declare one"
                " (see examples/own_model_plan.py), or apply TP yourself in configure_model with self.device_mesh['tp']"
            )
        for owner in owners:
            experts = expert_modules(owner.module, owner.plan)  # placed by EP below
            apply_tensor_parallel(
                owner.module, owner.plan, mesh["tp"], sequence_parallel, skip=experts, vocab_sharded_output=layout.pp == 1
            )
        if done.stages and sequence_parallel and owners[0].plan.positions:
            for stage in (s for s in done.stages if s.index != 0):  # the first stage counts them itself
                pass_global_positions(stage.module, owners[0].plan.positions, layout.tp)
    if layout.cp > 1:
        if not owners:
            raise PlanError(
                f"cp={layout.cp} but no module of {type(root).__name__} declares parallel_plan() with its attention;"
                " declare one (ParallelPlan.attention and .positions, see zoo/gpt.py), or use cp=1"
            )
        for owner in owners:
            apply_context_parallel(owner.module, owner.plan, mesh["cp"], cp_style)
    if layout.world_size > 1:
        for owner in owners:
            apply_expert_parallel(owner.module, owner.plan, mesh, layout)
    for owner in owners:
        blocks = list(owner.module.get_submodule(owner.plan.blocks))
        apply_activation_checkpointing(blocks, activation_checkpointing, ac_every_n_blocks)
        if compile_backend is not None:
            apply_compile(blocks, compile_backend)
    in_hook = grad_compression is not None or replicate_hierarchy is not None
    dp_mesh = data_parallel_mesh(mesh, layout, replicate_in_hook=in_hook)
    if dp_mesh is not None:
        for owner in owners:
            shard_experts(owner.module, owner.plan, mesh, layout, precision)
            blocks = owner.module.get_submodule(owner.plan.blocks)
            # each pipeline stage is an FSDP root of its own (one stage per rank: the model itself)
            stage_roots = [s.module for s in done.stages] if done.stages else [owner.module]
            apply_data_parallel(stage_roots, list(blocks), dp_mesh, layout, precision)
        for unit in _units_outside_owners(root, "", owners):
            apply_data_parallel([unit], [], dp_mesh, layout, precision)
        if grad_compression is not None:  # communication hooks come last
            attach_compression(root, grad_compression, mesh, layout)
        if replicate_hierarchy is not None:  # replaces the flat replicate all-reduce (compressed or not)
            attach_hierarchical_all_reduce(root, replicate_hierarchy, grad_compression)
    return done


def meta_modules(root: nn.Module) -> set[nn.Module]:
    """Modules holding parameters or buffers on the meta device (recorded before `to_empty`)."""
    return {
        m
        for m in root.modules()
        if any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    }


@torch.no_grad()
def materialize(root: nn.Module, owners: list[PlanOwner], device: torch.device) -> None:
    """Allocate meta tensors on `device` (each rank only its shards) and initialise them.

    Plan owners with init rules get layout-independent weights (lit_mesh.init); other modules their
    reset_parameters(). A module that has neither is an error, never silent uninitialised memory.
    """
    pending = meta_modules(root)
    if not pending:
        return
    tied = tied_parameters(root)
    root.to_empty(device=device)
    retie(tied, type(root).__name__)  # to_empty gives each use of a tied meta parameter its own copy
    for owner in owners:
        owned = set(owner.module.modules())
        if owner.plan.init and owned & pending:
            init_parameters(owner.module, owner.plan.init)
            pending -= {m for m in owned if not any(True for _ in m.buffers(recurse=False))}
        elif owned & pending and initialise_transformers_weights(owner.module):  # transformers' own init
            pending -= owned
    missing = []
    for module in root.modules():  # a fixed order: every rank draws the same random numbers
        if module not in pending:
            continue
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            _reset_whole(module, reset)
        else:
            missing.append(type(module).__name__)
    if missing:
        raise PlanError(
            f"modules {sorted(set(missing))} were created on the meta device but have no reset_parameters() and"
            " no init rules in a parallel_plan(); give them one, or create them outside configure_model"
        )


def _reset_whole(module: nn.Module, reset: Any) -> None:
    """Run reset_parameters() on whole tensors, then keep this rank's shards.

    DTensor random init on CPU draws per rank, so resetting the shards directly would make the weights
    depend on the layout; drawing whole tensors in a fixed order does not.
    """
    sharded = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    if not sharded:
        reset()
        return
    for name, p in sharded.items():
        whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
        module._parameters[name] = nn.Parameter(whole, requires_grad=p.requires_grad)
    try:
        reset()
    finally:
        drawn = {name: module._parameters[name] for name in sharded}
        module._parameters.update(sharded)  # the FSDP/TP-managed parameters go back in place
    for name, p in sharded.items():
        local = distribute_tensor(drawn[name].detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
