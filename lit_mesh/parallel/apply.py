"""The one place where plans are applied, in the one order:
MoE layer adapters -> split into pipeline stages -> float8 linears in the blocks -> TP/SP (1-D; a grid tp_mode: grid/apply.py) -> CP -> EP ->
activation checkpointing (the other blocks under SP: re-gathered inputs) -> torch.compile -> FSDP/HSDP/DDP per block (experts first) -> each stage's root ->
communication hooks.

"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import cast

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lit_mesh.comm.compression import CompressionRun
from lit_mesh.comm.hierarchical import Hierarchy, attach_hierarchical_all_reduce
from lit_mesh.comm.topology import Topology
from lit_mesh.init import draw_as
from lit_mesh.mesh import MeshAxis, MeshViews
from lit_mesh.options import MeshOptions
from lit_mesh.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed
from lit_mesh.parallel.compile import apply_compile, enable_async_tp
from lit_mesh.parallel.context import apply_context_parallel
from lit_mesh.parallel.data import apply_data_parallel, attach_compression, data_parallel_mesh
from lit_mesh.parallel.expert import (
    adapt_moe_layers,
    apply_expert_parallel,
    expert_modules,
    folds_experts,
    sequence_sharded_moe_plan,
    shard_experts,
)
from lit_mesh.parallel.float8 import convert_blocks, float8_tp_style, float8_tp_styles_apply
from lit_mesh.parallel.fsdp_arguments import mixed_precision_override, offload_policy
from lit_mesh.parallel.grid import average_over_replicas, parallelize_grid
from lit_mesh.parallel.pipeline.schedules import PipelineSettings
from lit_mesh.parallel.pipeline.sequential import sequential_owners
from lit_mesh.parallel.pipeline.split import (
    Stage,
    balanced_split,
    check_split,
    parameter_balanced_split,
    pass_global_positions,
    split_into_stages,
    stage_ranks,
)
from lit_mesh.parallel.pipeline.tied import tied_name_groups
from lit_mesh.parallel.regather import regather_in_backward, regathers_under
from lit_mesh.parallel.tensor import PlanError, apply_tensor_parallel
from lit_mesh.parallel.units import (
    Blocks,
    choose_blocks,
    innermost_first,
    parameters_outside,
    policy_modules,
    units_report,
)
from lit_mesh.plan import ParallelPlan, PlanOwner, declared_plan
from lit_mesh.rules import Facts, check


def find_plan_owners(root: nn.Module) -> list[PlanOwner]:
    """The outermost modules under `root` (root excluded) that declare a ParallelPlan (their own
    parallel_plan(), or a registered plan source's: transformers models)."""
    owners: list[PlanOwner] = []
    for name, module in root.named_modules():
        if not name or any(name.startswith(f"{o.name}.") for o in owners):
            continue
        declare = declared_plan(module)
        if declare is not None:
            plan = declare()
            if not isinstance(plan, ParallelPlan):
                raise PlanError(
                    f"{type(module).__name__}.parallel_plan() returned {type(plan).__name__}, not a ParallelPlan"
                )
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
    tied: list[list[str]] = field(default_factory=list)  # names of parameters shared across stages (before the cut)


def split_pipeline(
    root: nn.Module, owners: list[PlanOwner], mesh: MeshViews, pipeline: PipelineSettings
) -> Parallelized:
    """Cut the one plan owner into stages and keep this pp rank's (the first step of the order)."""
    owner = owners[0]  # one: lit_mesh/rules.py ("pp_needs_one_plan")
    n_blocks = len(cast(nn.ModuleList, owner.module.get_submodule(owner.plan.blocks)))
    pp_mesh = mesh[MeshAxis.PP]
    pp = pp_mesh.size()
    n_stages = pp * pipeline.local_stages()
    if pipeline.split:
        split = check_split(pipeline.split, n_blocks, n_stages)
    elif owner.plan.pp.balance == "parameters":
        blocks = cast(nn.Sequential, owner.module.get_submodule(owner.plan.blocks))
        sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
        split = parameter_balanced_split(sizes, n_stages)
    else:
        split = balanced_split(n_blocks, n_stages)
    ranks = stage_ranks(n_stages, pp, pipeline.placement)
    tied = tied_name_groups(owner.module)  # the whole model's names, before the cut leaves each stage its uses
    stages = split_into_stages(owner.module, owner.plan, split, ranks, pp_mesh.get_local_rank())
    for module in {id(m): m for m in (owner.module, *(s.module for s in stages))}.values():
        draw_as(module, {name: group[0] for group in tied for name in group[1:]})  # every copy drawn alike
    return Parallelized(owners, stages, ranks, tied)


def parallelize(
    root: nn.Module,
    mesh: MeshViews,
    options: MeshOptions,
    *,
    precision: str,
    compression: CompressionRun | None = None,
    replicate_hierarchy: Hierarchy | None = None,
    topology: Topology | None = None,
) -> Parallelized:
    """Apply every technique to `root` (the LightningModule) in the fixed order; a model that configure_model
    parallelised itself is left as it is. `compression` and `replicate_hierarchy`: the run's reduction hooks;
    `topology`: the run's nodes (ep_dispatch="by_node" splits the ep groups by them)."""
    if root in _APPLIED:  # a later loop of the same model (validate or test after fit): its plans are in place
        return _APPLIED[root]
    layout = mesh.layout
    self_parallelised = is_user_parallelised(root)
    owners = [] if self_parallelised else find_plan_owners(root)
    if not owners and not self_parallelised and layout.pp > 1:  # no plan: a plain nn.Sequential is cut by children
        owners = sequential_owners(root)
    # a model without a plan: its blocks found, or named by auto_wrap_policy / wrap() (lit_mesh/parallel/units.py)
    without_plan = not owners and not self_parallelised
    blocks = choose_blocks(root, options.fsdp.auto_wrap_policy) if without_plan else Blocks([], "")
    check(
        "setup",
        Facts(
            options=options,
            layout=layout,
            model_name=type(root).__name__,
            root=root,
            owners=owners,
            self_parallelised=self_parallelised,
            blocks=[name for name, _ in blocks.modules],
        ),
    )
    if self_parallelised:
        rank_zero_info("MeshStrategy: configure_model parallelised the model itself; no plan is applied")
        _APPLIED[root] = Parallelized([])
        return _APPLIED[root]
    memory, compile_backend = options.memory, options.compile.backend
    sequence_parallel = bool(options.mesh.sequence_parallel)  # None is resolved by MeshOptions from the tp_mode
    fold = folds_experts(layout, options.expert)  # whole experts, each tp rank routing its sequence shard
    for owner in owners:
        adapt_moe_layers(owner.module, owner.plan)
    done = split_pipeline(root, owners, mesh, options.pipeline) if layout.pp > 1 else Parallelized(owners)
    if options.float8.recipe is not None:  # before TP and FSDP: both act on the converted linears
        fsdp_sharded = layout.dp_shard * layout.cp > 1 and options.data.zero_stage != 1
        block_lists = _block_lists(owners, blocks, without_plan)
        conversion = convert_blocks(root, block_lists, options.float8.recipe, mesh.root.device_type, fsdp_sharded)
        rank_zero_info(conversion.report())
    grid_mode = layout.tp > 1 and options.tensor.mode != "1d"
    if grid_mode:  # with tp and DDP alone, every parameter in a plan owner (grid/rules.py)
        parallelize_grid(owners, mesh, options.tensor.mode, options.tensor.depth)
        if layout.dp_replicate > 1:
            average_over_replicas(owners, mesh.root.get_group(MeshAxis.DP_REPLICATE))
    elif layout.tp > 1:
        float8_styles = float8_tp_styles_apply(options.float8.recipe, sequence_parallel)
        for owner in owners:
            experts = expert_modules(owner.module, owner.plan)  # placed by EP below
            apply_tensor_parallel(
                owner.module,
                sequence_sharded_moe_plan(owner.module, owner.plan) if fold else owner.plan,
                mesh[MeshAxis.TP],
                sequence_parallel,
                skip=experts,
                vocab_sharded_output=layout.pp == 1,
                float8_styles=float8_tp_style if float8_styles else None,
            )
        if done.stages and sequence_parallel and layout.cp == 1:  # cp: below
            for stage in (s for s in done.stages if s.index != 0):  # the first stage counts them itself
                if hasattr(stage.module, "sequence_shards"):  # a plan's stage module (PipelinePlan.stage)
                    setattr(stage.module, "sequence_shards", layout.tp)  # noqa: B010 (an nn.Module's attribute)
                elif owners[0].plan.cp.positions:
                    pass_global_positions(stage.module, owners[0].plan.cp.positions, layout.tp)
    if layout.cp > 1:
        # under pp the positions go to each stage (interleaved stages are views made before this hook)
        sp_shards = layout.tp if sequence_parallel else 1
        entries = [(s.module, 1 if s.index == 0 else sp_shards) for s in done.stages or []]
        for owner in owners:
            apply_context_parallel(owner.module, owner.plan, mesh[MeshAxis.CP], options.context.style, entries)
    if layout.world_size > 1:
        by_node = topology if options.expert.dispatch == "by_node" else None
        for owner in owners:
            apply_expert_parallel(owner.module, owner.plan, mesh, layout, fold, by_node)
    if options.compile.async_tp:  # CUDA + NCCL, inductor, tp > 1 with SP: the rules of lit_mesh/parallel/compile.py
        enable_async_tp(mesh[MeshAxis.TP])
    block_lists = _block_lists(owners, blocks, without_plan)
    if without_plan:
        if options.fsdp.activation_checkpointing_policy is not None:  # FSDPStrategy's name: the modules it selects
            apply_activation_checkpointing(policy_modules(root, options.fsdp.activation_checkpointing_policy), "full")
    regather = sequence_parallel and layout.tp > 1 and not grid_mode and compile_backend is None
    regather &= regathers_under(options.pipeline.schedule, layout.pp)
    for block_list, indices in zip(block_lists, _block_indices(owners, without_plan), strict=True):
        apply_activation_checkpointing(
            block_list, memory.activation_checkpointing, memory.ac_every_n_blocks, indices, memory.ac_other_blocks
        )
        if regather:
            for block in block_list:  # AC recomputes the checkpointed ones (lit_mesh/parallel/regather.py)
                if not checkpointed(block):
                    regather_in_backward(block)
        if compile_backend is not None:
            apply_compile(block_list, compile_backend)
    in_hook = compression is not None or replicate_hierarchy is not None
    dp_mesh = None if grid_mode else data_parallel_mesh(mesh, layout, replicate_in_hook=in_hook)
    others = _units_outside_owners(root, "", owners)
    if without_plan:  # a container whose parameters all sit in blocks is no unit (an nn.ModuleList has no forward)
        others = [u for u in others if parameters_outside(u, block_lists[0])]
        names = {id(m): n for n, m in root.named_modules()}
        rank_zero_info(units_report(blocks, [names[id(u)] for u in others], type(root).__name__))
    zero_stage = options.data.zero_stage
    if dp_mesh is not None or fold:  # the experts first (their own FSDP units); whole experts under tp even without
        # data parallel: FSDP over the tp ranks sums their gradients
        for owner in owners:
            shard_experts(owner.module, owner.plan, mesh, layout, precision, zero_stage, fold)
    if dp_mesh is not None:
        fsdp = options.fsdp
        mp_policy = mixed_precision_override(fsdp.mixed_precision)  # FSDPStrategy's names; None: lit-mesh's own
        offload = offload_policy(fsdp.cpu_offload, mesh.root.device_type)
        for owner, block_list in zip(owners, block_lists):
            # each pipeline stage is an FSDP root of its own (one stage per rank: the model itself)
            stage_roots = [s.module for s in done.stages] if done.stages else [owner.module]
            apply_data_parallel(
                stage_roots, block_list, dp_mesh, layout, precision, zero_stage, mp_policy=mp_policy, offload=offload
            )
        inner = innermost_first(blocks) if without_plan else []  # nested units before the units holding them
        apply_data_parallel(others, inner, dp_mesh, layout, precision, zero_stage, mp_policy=mp_policy, offload=offload)
        # several stages per rank: each stage's view is an FSDP root outside the model's tree, hooked too
        views = [(f"stage{st.index}", st.module) for st in done.stages or [] if st.module is not owners[0].module]
        if compression is not None:  # communication hooks come last
            attach_compression(root, compression, mesh, layout, views)
        if replicate_hierarchy is not None:  # replaces the flat replicate all-reduce (compressed or not)
            attach_hierarchical_all_reduce(root, replicate_hierarchy, compression, views)
    _APPLIED[root] = done
    return done


def _block_lists(owners: list[PlanOwner], blocks: Blocks, without_plan: bool) -> list[list[nn.Module]]:
    """The blocks of each plan owner (a model without a plan: its blocks, found or named)."""
    if without_plan:
        return [[module for _, module in blocks.modules]]
    return [list(cast(nn.ModuleList, o.module.get_submodule(o.plan.blocks))) for o in owners]


def _block_indices(owners: list[PlanOwner], without_plan: bool) -> list[list[int] | None]:
    """Each owner's blocks' indices in the whole model: a pipeline stage keeps the original ones as names
    (lit_mesh/parallel/pipeline/split.py). None (their positions) without a plan, or where the blocks are not
    named by index (an nn.Sequential of named children)."""
    if without_plan:
        return [None]
    names = [list(o.module.get_submodule(o.plan.blocks)._modules) for o in owners]
    return [[int(n) for n in owner] if all(n.isdigit() for n in owner) else None for owner in names]


def already_parallelized(root: nn.Module) -> bool:
    """True once `parallelize` applied the plans to `root`: later loops must not materialise or load it again."""
    return root in _APPLIED


_APPLIED: weakref.WeakKeyDictionary[nn.Module, Parallelized] = weakref.WeakKeyDictionary()
