"""The rules of every unit (collected by lit_mesh/rules.py), enumerated: every rule has one input that breaks it (its
error or warning, with its message) and one that passes. A rule added without a case here fails
test_every_rule_has_a_case."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lit_mesh.comm.options import CompressionOptions
from lit_mesh.comm.topology import Topology
from lit_mesh.mesh import MeshDegrees, MeshLayout
from lit_mesh.options import (
    CheckpointOptions,
    CommunicationOptions,
    CompileOptions,
    DataParallelOptions,
    ExpertOptions,
    Float8Options,
    FSDPArguments,
    MemoryOptions,
    MeshOptions,
    TensorOptions,
)
from lit_mesh.parallel import float8
from lit_mesh.parallel.pipeline.schedules import SCHEDULES, PipelineSettings
from lit_mesh.plan import ContextPlan, ParallelPlan, PlanOwner, TensorPlan
from lit_mesh.rules import RULES, RULES_BY_NAME, Facts, enforce
from lit_mesh.training.precision import FP16MixedPrecision

O = MeshOptions()
DEGREES = dict(dp=None, dp_replicate=None, dp_shard=None, tp=1, cp=1, pp=1, ep=1)
FLOAT8 = replace(O, float8=Float8Options("tensorwise"))
FP16 = CommunicationOptions(compression=CompressionOptions(mode="fp16"))


def init(options: MeshOptions = O, **degrees: object) -> Facts:
    return Facts(degrees={**DEGREES, **degrees}, options=options)


def launch(
    layout: MeshLayout,
    options: MeshOptions = O,
    precision: str = "32-true",
    nodes: int = 1,
    device_type: str = "cpu",
    backend: str = "gloo",
) -> Facts:
    topology = Topology(nodes=nodes, devices_per_node=layout.world_size // nodes)
    return Facts(
        options=options,
        layout=layout,
        precision=precision,
        topology=topology,
        device_type=device_type,
        process_group_backend=backend,
    )


def setup(layout: MeshLayout, owners: list, options: MeshOptions = O, self_parallelised: bool = False) -> Facts:
    return Facts(options=options, layout=layout, model_name="Net", owners=owners, self_parallelised=self_parallelised)


def owner(moe_layer: str = "", stages: tuple[str, ...] = ("embedding",)) -> SimpleNamespace:
    moe = SimpleNamespace(layer=moe_layer) if moe_layer else None  # a MoEPlan, or None for a dense model
    pp = SimpleNamespace(first=stages, last=())  # a PipelinePlan: what runs before the blocks
    return SimpleNamespace(name="model", module=SimpleNamespace(), plan=SimpleNamespace(moe=moe, pp=pp))


def dense_owner(stages: tuple[str, ...] = ("embedding",)) -> SimpleNamespace:
    plan = SimpleNamespace(moe=None, blocks="layers", pp=SimpleNamespace(first=stages, last=()))
    return SimpleNamespace(name="model", module=SimpleNamespace(), plan=plan)


def tp_owner(**divides: int) -> SimpleNamespace:
    """A plan owner whose plan names the sizes tp must divide."""
    plan = SimpleNamespace(tp=SimpleNamespace(unavailable="", divides=divides))
    return SimpleNamespace(name="model", module=nn.Linear(2, 2), plan=plan)


def moe_owner(n_experts: int, moe: bool = True) -> SimpleNamespace:
    """A plan owner with one block holding an MoE layer of `n_experts` (or a dense block: moe=False)."""
    block = nn.Module()
    if moe:
        block.moe = nn.Linear(2, 2)
    root = nn.Module()
    root.blocks = nn.ModuleList([block])
    plan = SimpleNamespace(blocks="blocks", moe=SimpleNamespace(layer="moe", ep_divides={"n_experts": n_experts}))
    return SimpleNamespace(name="model", module=root, plan=plan)


def tied_owner() -> SimpleNamespace:
    embed, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = embed.weight  # tied input/output embeddings
    return SimpleNamespace(
        name="model", module=nn.ModuleDict({"embed": embed, "head": head}), plan=SimpleNamespace(moe=None)
    )


def planned(heads: int = 4, attention: str = "attention", positions: str = "positions") -> PlanOwner:
    """A plan owner with one block: the sizes a grid splits (heads), the attention CP swaps and its positions."""
    net = nn.Module()
    net.embed, net.layers, net.head = nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4)]), nn.Linear(4, 8, bias=False)
    plan = ParallelPlan("layers", tp=TensorPlan(divides={"n_heads": heads}), cp=ContextPlan(attention, positions))
    return PlanOwner("model", net, plan)


def with_root(facts: Facts, *owners: PlanOwner, extra: bool = False) -> Facts:
    """`facts` with a LightningModule holding `owners` (and a parameter outside them: a learned loss scale)."""
    root = nn.Module()
    for o in owners:
        root.add_module(o.name, o.module)
    if extra:
        root.temperature = nn.Parameter(torch.ones(1))
    return replace(facts, root=root, owners=list(owners))


def pipeline(pp: int, **settings: object) -> Facts:
    return init(replace(O, pipeline=PipelineSettings(**settings)), pp=pp)


def compiled_pipeline(schedule: str) -> Facts:
    return init(replace(O, pipeline=PipelineSettings(schedule), compile=CompileOptions(True, "aot_eager")), pp=2)


def test_checkpointed_blocks_are_refused_with_the_split_backward_too() -> None:
    rule = RULES_BY_NAME["split_backward_without_block_options"]
    for schedule in ("zero_bubble", "zbv", "dualpipev"):
        facts = init(replace(O, pipeline=PipelineSettings(schedule), memory=MemoryOptions("selective")), pp=2)
        assert rule.broken(facts) and rule.message(facts).startswith(
            f"activation_checkpointing with pp_schedule={schedule!r}"
        )
    assert not rule.broken(
        init(replace(O, pipeline=PipelineSettings("looped_bfs"), memory=MemoryOptions("full")), pp=2)
    )


PP2, CP2, TP2 = MeshLayout(pp=2, dp_shard=2), MeshLayout(dp_shard=2, cp=2), MeshLayout(dp_shard=2, tp=2)
DP4 = MeshLayout(dp_shard=4)
AC = replace(O, memory=MemoryOptions("full"))
ASYNC_TP = replace(O, compile=CompileOptions(True, "inductor", async_tp=True))
ZERO1, ZERO2 = replace(O, data=DataParallelOptions(1)), replace(O, data=DataParallelOptions(2))
TWO_BW = replace(O, pipeline=PipelineSettings("2bw"))
NO_SP = replace(O.mesh, sequence_parallel=False)
GRID2D = replace(O, tensor=TensorOptions("2d"), mesh=NO_SP)
GRID25D = replace(O, tensor=TensorOptions("2.5d", 2), mesh=NO_SP)
LIGHTNING_SIZES = replace(O, mesh=replace(O.mesh, data_parallel_size=2))
EP2 = MeshLayout(dp_shard=2, ep=2)
FOLD = replace(O, expert=ExpertOptions(tp=1))  # whole experts under tp
BY_NODE = replace(O, expert=ExpertOptions(dispatch="by_node"))  # two-stage dispatch where ep spans nodes


def zoo_moe_owner(**overrides: object) -> PlanOwner:
    """The zoo MoE (tiny, on the meta device) as a plan owner: its real plan, MoEPlan.token_wise included."""
    from zoo.moe import MoEConfig, MoETransformer

    with torch.device("meta"):
        net = MoETransformer(MoEConfig.from_preset("tiny", **overrides))
    return PlanOwner("model", net, net.parallel_plan())


GRID_TP4, GRID_DDP = MeshLayout(tp=4), MeshLayout(dp_replicate=2, tp=4)

# rule -> (facts that break it, the message or a part of it, facts that pass)
CASES: dict[str, tuple[Facts, str, Facts]] = {
    "one_auto_degree": (
        init(dp="auto", dp_shard="auto"),
        "dp='auto' and dp_shard='auto': only one degree may be 'auto'",
        init(dp="auto"),
    ),
    "lightning_sizes_alone": (
        init(LIGHTNING_SIZES, tp=2),
        "data_parallel_size/tensor_parallel_size (ModelParallelStrategy's"
        " names) together with tp=2: give either the two Lightning sizes",
        init(LIGHTNING_SIZES),
    ),
    "precision_supported": (
        Facts(precision="64-true"),
        "MeshStrategy does not support precision='64-true'; choose Trainer(precision=...) in",
        Facts(precision="bf16-mixed"),
    ),
    "fp16_needs_mesh_scaler": (
        Facts(precision="16-mixed", precision_plugin=SimpleNamespace(scaler=None)),
        "precision='16-mixed' under MeshStrategy needs a loss scaler that agrees over all ranks",
        Facts(precision="16-mixed", precision_plugin=FP16MixedPrecision("cpu")),
    ),
    "one_stage_schedule": (
        pipeline(2, schedule="gpipe", stages_per_rank=2),
        "pp_schedule='gpipe' runs one stage per rank, not pp_stages_per_rank=2",
        pipeline(2, schedule="gpipe", stages_per_rank=1),
    ),
    "interleaved_schedule_stages": (
        pipeline(2, schedule="interleaved_1f1b", stages_per_rank=1),
        "set pp_stages_per_rank >= 2",
        pipeline(2, schedule="interleaved_1f1b"),
    ),
    "v_schedule_two_stages": (
        pipeline(2, schedule="zbv", stages_per_rank=3),
        "runs exactly 2 stages per rank (V shape), not 3; set pp_stages_per_rank=2",
        pipeline(2, schedule="zbv", stages_per_rank=2),
    ),
    "pp_microbatches_for_schedule": (
        pipeline(4, schedule="1f1b", microbatches=2),
        "pp_schedule='1f1b' with pp=4 and 2"
        " micro-batches: it needs at least 4 micro-batches (one per stage); set pp_microbatches"
        " >= 4, or use pp_schedule='gpipe'",
        pipeline(4, schedule="1f1b"),
    ),
    "pp_split_per_stage": (
        pipeline(2, split=(1, 1, 2)),
        "pp_split=[1, 1, 2] has 3 entries but pp=2 x stages per rank 1 = 2 stages",
        pipeline(2, split=(1, 3)),
    ),
    "pipeline_options_need_pp": (
        pipeline(1, schedule="gpipe"),
        "pp_schedule, pp_microbatches, pp_stages_per_rank and pp_split need pp > 1",
        pipeline(2, schedule="gpipe"),
    ),
    "split_backward_without_block_options": (
        compiled_pipeline("zbv"),
        "compile_blocks with pp_schedule='zbv': this"
        " schedule splits each backward into an input-gradient pass and a later"
        " weight-gradient pass",
        compiled_pipeline("interleaved_1f1b"),
    ),
    "2bw_without_block_options": (
        init(replace(TWO_BW, memory=MemoryOptions("full")), pp=2),
        "activation_checkpointing"
        " with pp_schedule='2bw': each micro-batch's backward must use the weight version its"
        " forward used",
        init(replace(AC, pipeline=PipelineSettings("1f1b")), pp=2),
    ),
    "2bw_without_fp16_scaler": (
        launch(MeshLayout(pp=2), TWO_BW, precision="16-mixed"),
        "pp_schedule='2bw' with fp16 loss scaling: each batch's gradient is made over two steps",
        launch(MeshLayout(pp=2), TWO_BW, precision="bf16-mixed"),
    ),
    "2bw_pipeline_alone": (
        launch(PP2, TWO_BW),
        "pp_schedule='2bw' with data parallel fsdp (dp_replicate=1, dp_shard=2):"
        " PipeDream-2BW here runs pipeline parallel alone",
        launch(MeshLayout(pp=2), TWO_BW),
    ),
    "self_parallelised_without_pp": (
        setup(PP2, [], self_parallelised=True),
        "pp=2: configure_model parallelised the model itself",
        setup(DP4, [], self_parallelised=True),
    ),
    "pp_without_plan_needs_one_sequential": (
        replace(setup(PP2, []), root=nn.ModuleDict({"blocks": nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])})),
        "pp=2: Net declares no parallel_plan(), and without one only a network held as one nn.Sequential is cut into"
        " pipeline stages (by its children); blocks.0.weight, blocks.0.bias, blocks.1.weight (+1 more) lie outside any"
        " nn.Sequential (its repeated blocks: blocks.0-1 (Linear)). Declare parallel_plan() with a PipelinePlan on the"
        " network",
        replace(setup(PP2, [owner()]), root=nn.Linear(2, 2)),  # a declared plan: pp_needs_one_plan judges
    ),
    "pp_needs_one_plan": (
        setup(PP2, [owner(), owner()]),
        "pp > 1 pipelines one model that declares parallel_plan() (or, without one, one nn.Sequential); Net has"
        " ['model', 'model']",
        setup(PP2, [owner()]),
    ),
    "pp_moe_needs_stage_plan": (
        setup(PP2, [owner("moe", stages=())]),
        "pp=2 with the MoE model SimpleNamespace: its parallel_plan() declares no PipelinePlan",
        setup(PP2, [owner("moe")]),
    ),
    "2bw_without_moe": (
        setup(MeshLayout(pp=2), [owner("moe")], TWO_BW),
        "pp_schedule='2bw' with the MoE model SimpleNamespace: the 2bw driver does not carry MoE routing statistics",
        setup(MeshLayout(pp=2), [owner("moe")]),
    ),
    "pp_needs_stage_plan": (
        setup(PP2, [dense_owner(stages=())]),
        "pp=2 with SimpleNamespace: its plan declares no PipelinePlan (the modules before and after the blocks)",
        setup(PP2, [dense_owner()]),
    ),
    "2bw_without_tied_parameters": (
        setup(MeshLayout(pp=2), [tied_owner()], TWO_BW),
        "pp_schedule='2bw' with ModuleDict's tied parameters ['embed.weight = head.weight']: the embedding runs on"
        " the first pipeline stage and the output head on the last",
        setup(MeshLayout(pp=2), [tied_owner()]),
    ),
    "v_placement_fsdp_without_tied_parameters": (
        setup(PP2, [tied_owner()], replace(O, pipeline=PipelineSettings("zbv"))),
        "pp_schedule='zbv' places the first and the last stage on one rank, and ModuleDict's tied parameters"
        " ['embed.weight = head.weight'] would be sharded by both stages' FSDP (fsdp)",
        setup(MeshLayout(pp=2), [tied_owner()], replace(O, pipeline=PipelineSettings("zbv"))),
    ),
    "selective_ac_with_inductor_tp": (
        init(replace(O, memory=MemoryOptions("selective"), compile=CompileOptions(True, "inductor")), tp=2),
        "activation_checkpointing='selective' with compile_blocks (compile_backend="
        "'inductor') and tp=2: on this torch the gradients come out wrong",
        init(replace(O, memory=MemoryOptions("full"), compile=CompileOptions(True, "inductor")), tp=2),
    ),
    "async_tp_needs_compiled_sp": (
        init(replace(O, compile=CompileOptions(True, "aot_eager", async_tp=True)), tp=2),
        "async_tp=True with compile_blocks=True, compile_backend='aot_eager', tp=2,"
        " sequence_parallel=True: async TP (torch's micro-pipeline TP) fuses the",
        init(ASYNC_TP, tp=2),
    ),
    "zero_stage_with_pp": (
        init(ZERO2, pp=2),
        "zero_stage=2 with pp=2: under a pipeline each stage's parameters are already gathered once per step",
        init(ZERO2),
    ),
    "tp_mode_has_scheme": (
        init(replace(GRID2D, tensor=TensorOptions("4d")), tp=16),
        "tp_mode='4d' has no implementation in this version; use one of ['1d', '2.5d', '2d'",
        init(GRID2D, tp=4),
    ),
    "tp_grid_shape": (
        init(GRID25D, tp=12),
        "tp_mode='2.5d' needs tp = d * q * q with d = tp_depth = 2, but tp=12; use tp in [8, 18, 32, 50]",
        init(GRID25D, tp=8),
    ),
    "tp_grid_alone": (
        init(replace(GRID2D, mesh=O.mesh), tp=4, pp=2),
        "tp_mode='2d' with pp=2, sequence_parallel=True:"
        " the grid tensor-parallel schemes combine with dp_replicate (DDP) only",
        init(GRID2D, tp=4),
    ),
    "async_save_needs_sharded": (
        init(replace(O, checkpoint=CheckpointOptions(False, True))),
        "async_save=True writes sharded checkpoints: keep save_distributed_checkpoint=True",
        init(replace(O, checkpoint=CheckpointOptions(True, True))),
    ),
    "compression_state_needs_sharded": (
        init(replace(O, communication=FP16, checkpoint=CheckpointOptions(False))),
        "single-file checkpoints do not hold its per-rank state",
        init(replace(O, communication=FP16)),
    ),
    "model_parallel_divides_world": (
        Facts(degrees={**DEGREES, "tp": 3}, world_size=4),
        "pp=1 x cp=1 x tp=3 = 3 does not"
        " divide the world size 4 (devices x num_nodes); choose degrees whose product divides 4,"
        " e.g. tp in [1, 2, 4]",
        Facts(degrees={**DEGREES, "tp": 2}, world_size=4),
    ),
    "ep_divides_dp_shard_cp": (
        Facts(layout=MeshLayout(dp_shard=2, cp=2, ep=3)),
        "ep=3 does not divide dp_shard x cp = 2 x 2"
        " = 4 (expert parallel borrows its ranks from them, it does not add any); choose ep in [1, 2, 4]",
        Facts(layout=MeshLayout(dp_shard=2, cp=2, ep=4)),
    ),
    "async_tp_needs_cuda_nccl": (
        launch(TP2, ASYNC_TP),
        "async_tp=True on device 'cpu' with process group backend"
        " 'gloo': async TP (torch's micro-pipeline TP) exchanges tiles through CUDA symmetric"
        " memory and needs accelerator='cuda' with the 'nccl' backend",
        launch(TP2, ASYNC_TP, device_type="cuda", backend="nccl"),
    ),
    "tp_grid_shape_resolved": (
        launch(MeshLayout(tp=8), GRID2D),
        "tp_mode='2d' needs tp = q * q (a q x q grid), but tp=8; use tp in [4, 9, 16, 25, 36, 49]",
        launch(MeshLayout(tp=9), GRID2D),
    ),
    "tp_grid_without_sharded_dp": (
        launch(MeshLayout(dp_shard=2, tp=4), GRID2D),
        "tp_mode='2d' with sharded data parallelism (pp=1 x dp_replicate=1 x dp_shard=2",
        launch(MeshLayout(dp_replicate=2, tp=4), GRID2D),
    ),
    "compression_needs_data_parallel": (
        launch(MeshLayout(tp=2), replace(O, communication=FP16)),
        "grad_compression='fp16' but the mesh has no data-parallel dim",
        launch(DP4, replace(O, communication=FP16)),
    ),
    "zero_stage_needs_sharded_dp": (
        launch(MeshLayout(dp_replicate=2), ZERO1),
        "zero_stage=1 shards optimizer state"
        " over the sharded data-parallel dim, but the mesh has none (pp=1 x dp_replicate=2",
        launch(MeshLayout(dp_replicate=2, dp_shard=2), ZERO1),
    ),
    "topology_holds_mesh": (
        replace(launch(DP4), topology=Topology(nodes=1, devices_per_node=2)),
        "the mesh has 4 ranks",
        launch(DP4),
    ),
    "tp_inside_node_strict": (
        launch(MeshLayout(tp=4), replace(O, communication=CommunicationOptions(strict_topology=True)), nodes=2),
        "tp=4 does not divide the 2 devices of one node: tensor-parallel groups cross nodes (their"
        " all-reduces per layer then run at 50 GB/s instead of 450 GB/s); choose tp dividing 2 (or"
        " strict_topology=False to run anyway)",
        launch(MeshLayout(tp=4), nodes=2),
    ),
    "tp_inside_node": (
        launch(MeshLayout(tp=4), nodes=2),
        "tp=4 does not divide the 2 devices of one node",
        launch(MeshLayout(dp_replicate=2, tp=2), nodes=2),
    ),
    "cp_tp_inside_node": (
        launch(MeshLayout(cp=2, tp=2), nodes=2),
        "cp=2 x tp=2 = 4 does not divide the 2 devices of one node: context-parallel groups cross nodes",
        launch(MeshLayout(dp_replicate=2, tp=2), nodes=2),
    ),
    "self_parallelised_without_compression": (
        setup(DP4, [], replace(O, communication=FP16), self_parallelised=True),
        "grad_compression hooks into the data parallelism MeshStrategy applies",
        setup(DP4, [owner()], replace(O, communication=FP16)),
    ),
    "self_parallelised_without_zero_stage": (
        setup(DP4, [], ZERO2, self_parallelised=True),
        "zero_stage=2 chooses how MeshStrategy applies FSDP2",
        setup(DP4, [owner()], ZERO2),
    ),
    "self_parallelised_without_cp": (
        setup(CP2, [], self_parallelised=True),
        "cp=2 but configure_model of Net parallelised the model itself",
        setup(CP2, [owner()]),
    ),
    "self_parallelised_without_tp_grid": (
        setup(MeshLayout(tp=4), [], GRID2D, self_parallelised=True),
        "tp_mode='2d' is applied by MeshStrategy from a parallel_plan(), but configure_model of Net",
        setup(MeshLayout(tp=4), [owner()], GRID2D),
    ),
    "block_options_need_plan": (
        setup(DP4, [], AC),
        "activation_checkpointing acts on the blocks of a model, but no module of Net declares a parallel_plan() and"
        " no repeated blocks were found",
        replace(setup(DP4, [], AC), blocks=["model.layers.0", "model.layers.1"]),
    ),
    # FSDPStrategy's names (lit_mesh/parallel/fsdp_arguments.py)
    "sharding_strategy_or_dp_names": (
        init(replace(O, fsdp=FSDPArguments(sharding_strategy="NO_SHARD"), mesh=replace(O.mesh, dp=4)), dp=4),
        "sharding_strategy='NO_SHARD' (FSDPStrategy's name) and dp=4 (MeshStrategy's) both say how data parallelism"
        " shards; give one",
        init(replace(O, fsdp=FSDPArguments(sharding_strategy="NO_SHARD"))),
    ),
    "device_mesh_or_dp_names": (
        init(replace(O, fsdp=FSDPArguments(sharding_strategy="FULL_SHARD", device_mesh=(2, 2)))),
        "device_mesh=(2, 2) means dp_replicate=2, dp_shard=2 (HSDP); do not give sharding_strategy='FULL_SHARD'",
        init(replace(O, fsdp=FSDPArguments(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)))),
    ),
    "activation_checkpointing_policy_or_mode": (
        init(replace(AC, fsdp=FSDPArguments(activation_checkpointing_policy={nn.Linear}))),
        "activation_checkpointing_policy (FSDPStrategy's name) and activation_checkpointing='full' (MeshStrategy's)",
        init(replace(O, fsdp=FSDPArguments(activation_checkpointing_policy={nn.Linear}))),
    ),
    "state_dict_type_or_save_distributed_checkpoint": (
        init(replace(O, fsdp=FSDPArguments(state_dict_type="full"), checkpoint=CheckpointOptions(distributed=False))),
        "state_dict_type='full' (FSDPStrategy's name) and save_distributed_checkpoint=False (MeshStrategy's)",
        init(replace(O, fsdp=FSDPArguments(state_dict_type="full"))),
    ),
    "wrap_policies_without_plan": (
        setup(DP4, [owner()], replace(O, fsdp=FSDPArguments(auto_wrap_policy={nn.Linear}))),
        "auto_wrap_policy / activation_checkpointing_policy choose the units of a model without a plan, but model of"
        " Net declares a parallel_plan()",
        setup(DP4, [], replace(O, fsdp=FSDPArguments(auto_wrap_policy={nn.Linear}))),
    ),
    "wrap_policies_with_own_parallelism": (
        setup(DP4, [], replace(O, fsdp=FSDPArguments(cpu_offload=True)), self_parallelised=True),
        "configure_model of Net applied fully_shard (or DTensors) itself, so MeshStrategy applies no FSDP settings",
        setup(DP4, [], replace(O, fsdp=FSDPArguments(cpu_offload=True))),
    ),
    "cpu_offload_needs_fsdp": (
        launch(MeshLayout(), replace(O, fsdp=FSDPArguments(cpu_offload=True))),
        "cpu_offload keeps the FSDP units' parameters on the host, but this layout (pp=1",
        launch(DP4, replace(O, fsdp=FSDPArguments(cpu_offload=True))),
    ),
    "tp_needs_plan": (setup(TP2, []), "tp=2 but no module of Net declares parallel_plan()", setup(TP2, [owner()])),
    "cp_needs_plan": (
        setup(CP2, []),
        "cp=2 but no module of Net declares parallel_plan() with its attention",
        setup(CP2, [owner()]),
    ),
    "tp_fits_plan": (
        setup(TP2, [tp_owner(n_heads=4, n_kv_heads=3)]),
        "tp=2 does not divide n_kv_heads=3 of Linear (choose tp in [1, 3])",
        setup(TP2, [tp_owner(n_heads=4, n_kv_heads=2)]),
    ),
    "expert_tp_is_1_or_tp": (
        launch(MeshLayout(tp=4), replace(O, expert=ExpertOptions(tp=2))),
        "expert_tp=2 with tp=4: the experts are either split over all tp ranks (expert_tp=None, or tp) or whole on"
        " each (expert_tp=1)",
        launch(MeshLayout(tp=4), FOLD),
    ),
    "ep_needs_whole_experts": (
        launch(MeshLayout(dp_shard=2, tp=2, ep=4)),
        "ep=4 does not divide dp_shard x cp = 2 x 1 = 2 (expert parallel borrows its ranks from them, it does not add"
        " any); choose ep in [1, 2], or with expert_tp=1 (whole experts under tp, whose ep borrows tp ranks too) in"
        " [1, 2, 4]",
        launch(MeshLayout(dp_shard=2, tp=2, ep=4), FOLD),
    ),
    "ep_dispatch_by_node_fits_topology": (
        launch(MeshLayout(dp_shard=3, tp=2, ep=3), BY_NODE, nodes=2),
        "ep_dispatch='by_node' with ep=3 on 2 nodes x 3 devices: an ep group [0, 2, 4] holds unequal numbers of ranks"
        " on the nodes it spans; choose ep so that each node holds the same consecutive share",
        launch(MeshLayout(dp_shard=4, tp=2, ep=4), BY_NODE, nodes=2),
    ),
    "expert_tp_1_needs_sequence_parallel": (
        launch(MeshLayout(tp=2), replace(FOLD, mesh=MeshDegrees(sequence_parallel=False))),
        "expert_tp=1 with tp=2 routes each tp rank's shard of the sequence, which only sequence_parallel makes; use"
        " sequence_parallel=True (tp_mode='1d'), or expert_tp=None",
        launch(MeshLayout(tp=2), FOLD),
    ),
    "expert_tp_1_fits_plan": (
        setup(MeshLayout(tp=2), [zoo_moe_owner(capacity_factor=1.25)], FOLD),
        "expert_tp=1 with MoETransformer's capacity_factor=1.25: capacity counts per sequence, which the tp ranks"
        " split; use capacity_factor=None (dropless), or expert_tp=None",
        setup(MeshLayout(tp=2), [zoo_moe_owner(n_shared_experts=1)], FOLD),
    ),
    "ep_fits_plan": (
        setup(EP2, [moe_owner(n_experts=3)]),
        "ep=2 does not divide n_experts=3 of Module (choose ep in [1, 3])",
        setup(EP2, [moe_owner(n_experts=4)]),
    ),
    "cp_fits_plan": (
        setup(CP2, [planned(attention="")]),
        "cp=2 but Module.parallel_plan() declares no attention module (ContextPlan.attention)",
        setup(CP2, [planned()]),
    ),
    "tp_grid_fits_plan": (
        setup(GRID_TP4, [planned(heads=3)], GRID2D),
        "tp_mode='2d' on a grid of depth 1 x 2 x 2 splits n_heads=3 of Module into q=2 blocks",
        setup(GRID_TP4, [planned()], GRID2D),
    ),
    "float8_needs_torchao": (  # torchao taken away by PATCHES below
        init(FLOAT8),
        "torchao is needed for float8 training (MeshStrategy(float8=...)) but is not installed; install it with: pip"
        " install 'lit-mesh[fp8]'",
        init(O),
    ),
    "float8_needs_1d_tp": (
        init(replace(FLOAT8, tensor=TensorOptions("2d")), tp=4),
        "float8='tensorwise' with tp_mode='2d': torchao's float8 linears have tensor-parallel styles for the 1-D"
        " column/row split only",
        init(FLOAT8, tp=4),
    ),
    "float8_on_a_model_lit_mesh_parallelises": (
        setup(DP4, [], FLOAT8, self_parallelised=True),
        "float8='tensorwise' but configure_model parallelised Net itself",
        setup(DP4, [owner()], FLOAT8),
    ),
    "float8_needs_sm89_on_cuda": (  # no GPU (PATCHES below): a CUDA device without float8 matmuls
        launch(DP4, FLOAT8, device_type="cuda", backend="nccl"),
        "float8='tensorwise' on a GPU of compute capability unknown: float8 matmuls need 8.9 or newer",
        launch(DP4, FLOAT8),
    ),
    "tp_grid_replicas_need_planned_parameters": (
        with_root(setup(GRID_DDP, [], GRID2D), planned(), extra=True),
        "tp_mode='2d' with dp_replicate: parameters ['temperature'] are"
        " outside the modules that declare a parallel_plan()",
        with_root(setup(GRID_DDP, [], GRID2D), planned()),
    ),
}


# what a rule's broken case needs of the machine: (module, attribute, value) set for the whole test
PATCHES: dict[str, tuple[object, str, object]] = {
    "float8_needs_torchao": (float8, "torchao_installed", lambda: False),
    "float8_needs_sm89_on_cuda": (torch.cuda, "is_available", lambda: False),
}


def test_every_rule_has_a_case() -> None:
    assert sorted(rule.name for rule in RULES) == sorted(CASES)  # same rules
    assert len(RULES_BY_NAME) == len(RULES)  # names are unique


def test_ep_refuses_a_dense_model() -> None:
    rule = RULES_BY_NAME["ep_fits_plan"]
    dense = setup(EP2, [moe_owner(n_experts=4, moe=False)])
    assert (
        rule.message(dense)
        == "ep=2 but Module.parallel_plan() declares no MoE layer (ParallelPlan.moe); use ep=1 for a dense model"
    )
    assert not rule.broken(setup(MeshLayout(dp_shard=2), [moe_owner(n_experts=4, moe=False)]))  # ep=1: nothing to split


def test_whole_experts_need_every_parameter_outside_the_experts_declared_token_wise() -> None:
    """A plan whose MoE layer holds parameters outside `experts` and MoEPlan.token_wise (here: the shared experts left
    out) is refused under expert_tp=1, naming them: their gradients would miss the other tp ranks' tokens."""
    owner = zoo_moe_owner(n_shared_experts=1)
    assert owner.plan.moe is not None
    plan = replace(owner.plan, moe=replace(owner.plan.moe, token_wise=("router.gate",)))
    facts = setup(MeshLayout(tp=2), [PlanOwner("model", owner.module, plan)], FOLD)
    rule = RULES_BY_NAME["expert_tp_1_fits_plan"]
    assert rule.broken(facts)
    assert rule.message(facts).startswith(
        "expert_tp=1 with MoETransformer: the parameters ['shared_experts.w1.weight', 'shared_experts.w3.weight',"
        " 'shared_experts.w2.weight'] of its MoE layer 'moe' lie outside `experts` and outside MoEPlan.token_wise"
    )
    assert not rule.broken(setup(MeshLayout(tp=2), [PlanOwner("model", owner.module, plan)]))  # expert_tp=None


@pytest.mark.parametrize("name", list(CASES))
def test_rule(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if name in PATCHES:
        monkeypatch.setattr(*PATCHES[name])
    rule = RULES_BY_NAME[name]
    broken, message, passing = CASES[name]
    assert not rule.broken(passing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enforce(rule, passing)
    assert rule.broken(broken)
    assert message in rule.message(broken)
    if rule.warn_only:
        with pytest.warns(UserWarning, match=re.escape(message)):
            enforce(rule, broken)
    else:
        with pytest.raises(rule.error, match=re.escape(message)):
            enforce(rule, broken)


@pytest.mark.parametrize("pp", [2, 4])
def test_microbatch_rule_agrees_with_torchs_schedules(pp: int) -> None:
    """pp_microbatches_for_schedule refuses, before processes start, exactly the counts torch's schedule constructors
    raise on (inside every rank), for every schedule: built here over a fake process group of pp ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        for name, (schedule_cls, _, placement) in SCHEDULES.items():
            if schedule_cls is None:  # lit-mesh's own driver (2bw): test_2bw_needs_one_microbatch_per_stage
                continue
            for count in [None, *range(1, 3 * pp + 2)]:
                settings = PipelineSettings(name, count)
                per_rank, n_stages = settings.local_stages(), pp * settings.local_stages()
                # rank 0's stages: 0, then pp, 2 pp, ... (loop) or the last one (V)
                indices = [0, n_stages - 1] if placement == "v" else list(range(0, n_stages, pp))
                stages = [PipelineStage(torch.nn.Linear(2, 2), i, n_stages, torch.device("cpu")) for i in indices]
                try:
                    schedule_cls(
                        stages if per_rank > 1 else stages[0],
                        n_microbatches=settings.n_microbatches(pp),
                        loss_fn=torch.nn.functional.mse_loss,
                        scale_grads=False,
                    )
                    accepted = True
                except ValueError:
                    accepted = False
                refused = RULES_BY_NAME["pp_microbatches_for_schedule"].broken(
                    pipeline(pp, schedule=name, microbatches=count)
                )
                assert accepted != refused, (name, pp, count, accepted)
    finally:
        dist.destroy_process_group()


def test_microbatch_refusals_name_counts_that_work() -> None:
    rule = RULES_BY_NAME["pp_microbatches_for_schedule"]
    assert "needs at least 4 micro-batches (one per stage); set pp_microbatches >= 4, or use pp_schedule='zbv'" in (
        rule.message(pipeline(2, schedule="dualpipev", microbatches=3))
    )
    assert (
        "runs micro-batches in 2 rounds of pp=2 and 5 is not a multiple of 2; set pp_microbatches to a multiple of 2"
        in (rule.message(pipeline(2, schedule="zero_bubble", microbatches=5)))
    )
    assert not rule.broken(pipeline(2, schedule="dualpipev"))  # its default: one micro-batch per stage, 2 x pp


def test_2bw_needs_one_microbatch_per_stage() -> None:
    """Its continuous 1F1B finishes the previous batch's backwards within a step only with m >= pp (at most two
    weight versions); no other schedule is offered in the refusal (each would change the training rule)."""
    rule = RULES_BY_NAME["pp_microbatches_for_schedule"]
    message = rule.message(pipeline(4, schedule="2bw", microbatches=3))
    assert message.endswith("needs at least 4 micro-batches (one per stage); set pp_microbatches >= 4"), message
    assert not rule.broken(pipeline(4, schedule="2bw")) and not rule.broken(pipeline(4, schedule="2bw", microbatches=4))


def test_2bw_names_everything_it_runs_without() -> None:
    rule = RULES_BY_NAME["2bw_pipeline_alone"]
    message = rule.message(launch(MeshLayout(pp=2, tp=2, cp=2, dp_replicate=2, dp_shard=2, ep=2), TWO_BW))
    assert "pp_schedule='2bw' with tp=2, cp=2, ep=2, data parallel hsdp (dp_replicate=2, dp_shard=2)" in message
    assert not rule.broken(launch(PP2))  # the synchronous schedules combine with them
    compiled = RULES_BY_NAME["2bw_without_block_options"]
    assert compiled.broken(init(replace(TWO_BW, compile=CompileOptions(True, "aot_eager")), pp=2))
    assert not compiled.broken(init(replace(TWO_BW, compile=CompileOptions(True, "aot_eager"))))  # pp=1: no pipeline
