"""Every cross-feature rule of MeshStrategy in one table: what may combine with what, what must divide what.

A rule is data (lit_mesh/unit.py): a name, the phase that checks it, a predicate that is True when the rule is
broken, and a message with the numbers and the fix.
Single-value checks ("tp must be >= 1", "cp_style must be one of ...") stay beside the option they check.
"""

from __future__ import annotations

from typing import Any, Optional

from lit_mesh.errors import (
    CompressionConfigError,
    PipelineConfigError,
    PlanError,
    TopologyError,
    WorldSizeError,
)
from lit_mesh.parallel.context import rules as context
from lit_mesh.parallel.grid import rules as grid
from lit_mesh.unit import Facts, Phase, Rule, divisors, enforce  # noqa: F401 - divisors, enforce re-exported


def _schedule_kind(f: Facts) -> str:
    from lit_mesh.parallel.pipeline import SCHEDULES

    return SCHEDULES[f.options.pipeline.schedule][1]


def _microbatch_problem(f: Facts) -> Optional[str]:
    from lit_mesh.parallel.pipeline import microbatch_problem

    return microbatch_problem(f.options.pipeline, f.degrees["pp"])


def _splits_backward(f: Facts) -> bool:
    from lit_mesh.parallel.pipeline import SPLIT_BACKWARD

    return f.options.pipeline.schedule in SPLIT_BACKWARD


def _block_options(f: Facts) -> list[str]:
    asked = {"activation_checkpointing": f.options.memory.activation_checkpointing != "none",
             "compile_blocks": f.options.compile.backend is not None}  # fmt: skip
    return [name for name, on in asked.items() if on]


def _pipeline_options_given(p: Any) -> bool:
    return p.schedule != "1f1b" or p.microbatches is not None or p.stages_per_rank is not None or bool(p.split)


def _is_2bw(f: Facts) -> bool:
    return f.options.pipeline.schedule == "2bw" and f.degree("pp") != 1


def _beside_2bw(f: Facts) -> list[str]:
    """What the mesh combines with pp under 2bw: its driver keeps two plain weight versions per stage and steps
    them itself (lit_mesh/parallel/pipeline_2bw.py), with no sharded, tensor-parallel or reduced parameters."""
    layout = f.layout
    found = [f"{n}={getattr(layout, n)}" for n in ("tp", "cp", "ep") if getattr(layout, n) > 1]
    if layout.data_parallel != "none":
        found.append(f"data parallel {layout.data_parallel} (dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard})")
    return found

def _phase(unit_rules: list[Rule], phase: Phase) -> list[Rule]:
    """A unit's rules of one phase, in its order: where the table places them."""
    return [rule for rule in unit_rules if rule.phase == phase]


def _node_devices(f: Facts) -> int:
    return f.topology.devices_per_node


def _gbps(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:g} GB/s"


RULES: tuple[Rule, ...] = (
    # ---- init: the arguments alone ---------------------------------------------------------------------------
    Rule(
        "one_auto_degree", "init",
        lambda f: f.degrees.get("dp") == "auto" and f.degrees.get("dp_shard") == "auto",
        lambda f: "dp='auto' and dp_shard='auto': only one degree may be 'auto'; give the other a number",
    ),
    Rule(
        "one_stage_schedule", "init",
        lambda f: f.options.pipeline.stages_per_rank not in (None, 1) and _schedule_kind(f) == "one",
        lambda f: f"pp_schedule={f.options.pipeline.schedule!r} runs one stage per rank, not pp_stages_per_rank="
        f"{f.options.pipeline.stages_per_rank}; use 'interleaved_1f1b', 'looped_bfs' or 'zero_bubble' for several",
        PipelineConfigError,
    ),
    Rule(
        "interleaved_schedule_stages", "init",
        lambda f: (f.options.pipeline.stages_per_rank or 2) < 2 and _schedule_kind(f) == "many",
        lambda f: f"pp_schedule={f.options.pipeline.schedule!r} interleaves several stages per rank, but pp_stages_per_rank="
        f"{f.options.pipeline.stages_per_rank}; set pp_stages_per_rank >= 2, or use '1f1b' for one stage per rank",
        PipelineConfigError,
    ),
    Rule(
        "v_schedule_two_stages", "init",
        lambda f: f.options.pipeline.stages_per_rank not in (None, 2) and _schedule_kind(f) == "two",
        lambda f: f"pp_schedule={f.options.pipeline.schedule!r} runs exactly 2 stages per rank (V shape), not"
        f" {f.options.pipeline.stages_per_rank}; set pp_stages_per_rank=2",
        PipelineConfigError,
    ),
    Rule(
        "pp_microbatches_for_schedule", "init",
        lambda f: f.degrees["pp"] > 1 and _microbatch_problem(f) is not None,
        lambda f: f"pp_schedule={f.options.pipeline.schedule!r} with pp={f.degrees['pp']} and"
        f" {f.options.pipeline.n_microbatches(f.degrees['pp'])} micro-batches: it {_microbatch_problem(f)}",
        PipelineConfigError,
    ),
    Rule(
        "pp_split_per_stage", "init",
        lambda f: f.options.pipeline.split is not None
        and len(f.options.pipeline.split) != f.degrees["pp"] * f.options.pipeline.local_stages(),
        lambda f: f"pp_split={list(f.options.pipeline.split)} has {len(f.options.pipeline.split)} entries but"
        f" pp={f.degrees['pp']} x stages per rank {f.options.pipeline.local_stages()} ="
        f" {f.degrees['pp'] * f.options.pipeline.local_stages()} stages; give one number of blocks per stage",
        PipelineConfigError,
    ),
    Rule(
        "pipeline_options_need_pp", "init",
        lambda f: f.degrees["pp"] == 1 and _pipeline_options_given(f.options.pipeline),
        lambda f: "pp_schedule, pp_microbatches, pp_stages_per_rank and pp_split need pp > 1",
        PipelineConfigError,
    ),
    Rule(
        # measured on torch 2.13 (benchmarks/compile_tp_repro.py --backend inductor): selective checkpointing
        # around inductor-compiled TP blocks gives wrong weight gradients (wv off by 0.057); full checkpointing,
        # aot_eager, selective + inductor without TP, and the same policy without the collectives in its saved set
        # all match one device to 1e-7: the saved outputs of the collectives inductor's code calls are not the
        # values recompute needs
        "selective_ac_with_inductor_tp", "init",
        lambda f: f.options.memory.activation_checkpointing == "selective" and f.options.compile.backend == "inductor"
        and f.degrees["tp"] != 1,
        lambda f: f"activation_checkpointing='selective' with compile_blocks (compile_backend='inductor') and"
        f" tp={f.degrees['tp']}: on this torch the gradients come out wrong (benchmarks/compile_tp_repro.py --backend"
        " inductor, case lit-mesh-ac-selective-sp: the collective outputs it saves); use activation_checkpointing="
        "'full', or compile_backend='aot_eager', or tp=1",
    ),
    Rule(
        # torch's micro-pipeline TP is an inductor pass that fuses the SP all-gather/reduce-scatter with the
        # matmuls next to them; it needs a compiled, sequence-parallel TP region to find them
        "async_tp_needs_compiled_sp", "init",
        lambda f: f.options.compile.async_tp and (
            f.options.compile.backend != "inductor" or f.degrees["tp"] == 1 or not f.options.mesh.sequence_parallel
        ),
        lambda f: f"async_tp=True with compile_blocks={f.options.compile.backend is not None}, compile_backend="
        f"{f.options.compile.backend!r}, tp={f.degrees['tp']}, sequence_parallel={f.options.mesh.sequence_parallel}:"
        " async TP (torch's micro-pipeline TP) fuses the sequence-parallel collectives into the matmuls in inductor;"
        " set compile_blocks=True, compile_backend='inductor', tp > 1 and sequence_parallel=True, or async_tp=False",
    ),
    Rule(
        # measured on torch 2.13: compiled blocks fail in the input-gradient pass inside AOTAutograd ("compiled with
        # non-empty donated buffers which requires ... retain_graph=False"); checkpointed blocks fail in the weight-
        # gradient pass (the composable checkpoint's recompute context is entered a second time: AttributeError)
        "split_backward_without_block_options", "init",
        lambda f: f.degrees["pp"] > 1 and _splits_backward(f) and bool(_block_options(f)),
        lambda f: f"{_block_options(f)[0]} with pp_schedule={f.options.pipeline.schedule!r}: this schedule splits each"
        " backward into an input-gradient pass and a later weight-gradient pass over every block, but a compiled"
        " block's backward is one graph that cannot be split and a checkpointed block is recomputed only once per"
        " forward; use pp_schedule='interleaved_1f1b' (or '1f1b', 'gpipe', 'looped_bfs') with it, or turn it off",
        PipelineConfigError,
    ),
    Rule(
        # torch's PipelineStage keeps FSDP units gathered over the micro-batches and reduces once at the last one
        "zero_stage_with_pp", "init",
        lambda f: f.options.data.zero_stage != 3 and f.degrees["pp"] > 1,
        lambda f: f"zero_stage={f.options.data.zero_stage} with pp={f.degrees['pp']}: under a pipeline each stage's"
        " parameters are already gathered once per step and its gradients reduced once, at the last micro-batch"
        " (torch's PipelineStage), with parameters, gradients and optimizer state sharded between steps; zero_stage"
        " applies to pp=1 only: leave it at 3 with pp, or use pp=1",
    ),
    Rule(
        # a checkpointed block recomputes its forward in backward, one step later under 2bw, from the live weights
        # (W_{t+1}) instead of the version its forward used; compiled blocks are traced against the parameters
        # that functional_call swaps for each version
        "2bw_without_block_options", "init",
        lambda f: _is_2bw(f) and bool(_block_options(f)),
        lambda f: f"{_block_options(f)[0]} with pp_schedule='2bw': each micro-batch's backward must use the weight"
        " version its forward used, and a checkpointed or compiled block would recompute or trace with the"
        " parameters' live values; turn it off, or use pp_schedule='1f1b'",
        PipelineConfigError,
    ),
    *_phase(grid.RULES, "init"),
    Rule(
        "async_save_needs_sharded", "init",
        lambda f: f.options.checkpoint.asynchronous and not f.options.checkpoint.distributed,
        lambda f: "async_save=True writes sharded checkpoints: keep save_distributed_checkpoint=True",
        ValueError,
    ),
    Rule(
        "compression_state_needs_sharded", "init",
        lambda f: f.options.communication.compression is not None and not f.options.checkpoint.distributed,
        lambda f: "grad_compression: single-file checkpoints do not hold its per-rank state; a resume restarts it",
        warn_only=True,
    ),
    # ---- layout: the degrees against the world size ------------------------------------------------------------
    Rule(
        "model_parallel_divides_world", "layout",
        lambda f: f.world_size % (f.degrees["pp"] * f.degrees["cp"] * f.degrees["tp"]) != 0,
        lambda f: f"pp={f.degrees['pp']} x cp={f.degrees['cp']} x tp={f.degrees['tp']} ="
        f" {f.degrees['pp'] * f.degrees['cp'] * f.degrees['tp']} does not divide the world size {f.world_size}"
        f" (devices x num_nodes); choose degrees whose product divides {f.world_size},"
        f" e.g. tp in {divisors(f.world_size)}",
        WorldSizeError,
    ),
    Rule(
        "ep_divides_dp_shard_cp", "layout",
        lambda f: f.layout is not None and (f.layout.dp_shard * f.layout.cp) % f.layout.ep != 0,
        lambda f: f"ep={f.layout.ep} does not divide dp_shard x cp = {f.layout.dp_shard} x {f.layout.cp} ="
        f" {f.layout.dp_shard * f.layout.cp} (expert parallel borrows its ranks from them, it does not add any);"
        f" choose ep in {divisors(f.layout.dp_shard * f.layout.cp)}",
    ),
    # ---- launch: layout, precision and topology, before any process spawns ---------------------------------------
    Rule(
        "pp_with_fp16_scaler", "launch",
        lambda f: f.layout.pp > 1 and f.precision == "16-mixed",
        lambda f: f"pp={f.layout.pp} with fp16 loss scaling: the pipeline schedule runs the backward itself, outside"
        " the scaler; use precision='bf16-mixed' (no scaler needed) or pp=1",
    ),
    Rule(
        "2bw_pipeline_alone", "launch",
        lambda f: _is_2bw(f) and bool(_beside_2bw(f)),
        lambda f: f"pp_schedule='2bw' with {', '.join(_beside_2bw(f))}: PipeDream-2BW here runs pipeline parallel"
        f" alone (every rank one stage, world size = pp={f.layout.pp}), keeping two plain weight versions per stage;"
        " give pp = the world size with tp=1, cp=1, ep=1 and no dp, or use pp_schedule='1f1b' to combine them",
        PipelineConfigError,
    ),
    Rule(
        "async_tp_needs_cuda_nccl", "launch",
        lambda f: f.options.compile.async_tp and (f.device_type != "cuda" or f.process_group_backend != "nccl"),
        lambda f: f"async_tp=True on device {f.device_type!r} with process group backend"
        f" {f.process_group_backend!r}: async TP (torch's micro-pipeline TP) exchanges tiles through CUDA symmetric"
        " memory and needs accelerator='cuda' with the 'nccl' backend; on this machine set async_tp=False (plain TP,"
        " compiled or not, runs here)",
    ),
    *_phase(grid.RULES, "launch"),
    Rule(
        "compression_needs_data_parallel", "launch",
        lambda f: f.options.communication.compression is not None and f.layout.data_parallel == "none",
        lambda f: f"grad_compression={f.options.communication.compression.mode!r} but the mesh has no data-parallel"
        f" dim ({f.layout.describe()}): there is no gradient reduction to compress; give dp or dp_replicate > 1,"
        " or set grad_compression=None",
        CompressionConfigError,
    ),
    Rule(
        "zero_stage_needs_sharded_dp", "launch",
        lambda f: f.options.data.zero_stage != 3 and f.layout.data_parallel in ("none", "ddp"),
        lambda f: f"zero_stage={f.options.data.zero_stage} shards optimizer state"
        f"{' and gradients' if f.options.data.zero_stage == 2 else ''} over the sharded data-parallel dim, but the"
        f" mesh has none ({f.layout.describe()}): "
        + ("dp_replicate alone keeps everything whole (DDP, ZeRO stage 0); " if f.layout.data_parallel == "ddp" else
           "one data-parallel rank has nothing to shard; ")
        + "give dp (or dp_shard) > 1, or leave zero_stage=3",
    ),
    Rule(
        "topology_holds_mesh", "launch",
        lambda f: f.layout.world_size != f.topology.world_size,
        lambda f: f"the mesh has {f.layout.world_size} ranks ({f.layout.describe()}) but the topology has"
        f" {f.topology.nodes} nodes x {f.topology.devices_per_node} devices = {f.topology.world_size}; give"
        f" nodes x devices_per_node = {f.layout.world_size}",
        TopologyError,
    ),
    Rule(
        "tp_inside_node_strict", "launch",
        lambda f: f.options.communication.strict_topology and _node_devices(f) % f.layout.tp != 0,
        lambda f: _tp_across_nodes(f) + " (or strict_topology=False to run anyway)",
        TopologyError,
    ),
    Rule(
        "tp_inside_node", "launch",
        lambda f: _node_devices(f) % f.layout.tp != 0,
        lambda f: _tp_across_nodes(f),
        warn_only=True,
    ),
    *_phase(context.RULES, "launch"),
    # ---- setup: the model ----------------------------------------------------------------------------------------
    Rule(
        "self_parallelised_without_pp", "setup",
        lambda f: f.self_parallelised and f.layout.pp > 1,
        lambda f: f"pp={f.layout.pp}: configure_model parallelised the model itself, so MeshStrategy cannot cut it"
        " into pipeline stages; declare a parallel_plan() instead, or use pp=1",
    ),
    Rule(
        "self_parallelised_without_compression", "setup",
        lambda f: f.self_parallelised and f.options.communication.compression is not None,
        lambda f: "grad_compression hooks into the data parallelism MeshStrategy applies, but configure_model"
        " parallelised the model itself; let MeshStrategy apply it (a parallel_plan()), or drop grad_compression",
        CompressionConfigError,
    ),
    Rule(
        "self_parallelised_without_zero_stage", "setup",
        lambda f: f.self_parallelised and f.options.data.zero_stage != 3,
        lambda f: f"zero_stage={f.options.data.zero_stage} chooses how MeshStrategy applies FSDP2, but configure_model"
        f" of {f.model_name} parallelised the model itself; pass reshard_after_forward=False to your fully_shard"
        " calls (ZeRO-2), or let MeshStrategy apply a parallel_plan()",
    ),
    Rule(
        "pp_needs_one_plan", "setup",
        lambda f: not f.self_parallelised and f.layout.pp > 1 and len(f.owners) != 1,
        lambda f: f"pp > 1 pipelines one model that declares parallel_plan(); {f.model_name} has"
        f" {[o.name for o in f.owners] or 'none'}. Declare a plan on the network (see examples/own_model_plan.py),"
        " or use pp=1",
        PlanError,
    ),
    Rule(
        "pp_moe_needs_stage_plan", "setup",
        lambda f: not f.self_parallelised and f.layout.pp > 1 and f.owners[0].plan.moe is not None
        and not (f.owners[0].plan.pp.first or f.owners[0].plan.pp.last),
        lambda f: f"pp={f.layout.pp} with the MoE model {type(f.owners[0].module).__name__}: its parallel_plan()"
        " declares no PipelinePlan (the modules before and after the blocks), so it cannot be cut into stages;"
        " declare pp=PipelinePlan(first=..., last=...) as zoo/moe.py does, or use pp=1 (ep, dp, tp and cp work"
        " with MoE)",
        PlanError,
    ),
    Rule(
        # MoE under pp carries router statistics and expert reductions through torch's schedule steps
        "2bw_without_moe", "setup",
        lambda f: not f.self_parallelised and _is_2bw(f) and bool(f.owners) and f.owners[0].plan.moe is not None,
        lambda f: f"pp_schedule='2bw' with the MoE model {type(f.owners[0].module).__name__}: the 2bw driver does not"
        " carry MoE routing statistics or auxiliary losses across its delayed steps; use pp_schedule='1f1b' with MoE",
        PipelineConfigError,
    ),
    Rule(
        "block_options_need_plan", "setup",
        lambda f: not f.self_parallelised and not f.owners and bool(_block_options(f)),
        lambda f: f"{_block_options(f)[0]} acts on the blocks a parallel_plan() names, but no module of"
        f" {f.model_name} declares one; declare one (see examples/own_model_plan.py)",
        PlanError,
    ),
    Rule(
        "tp_needs_plan", "setup",
        lambda f: not f.self_parallelised and f.layout.tp > 1 and not f.owners,
        lambda f: f"tp={f.layout.tp} but no module of {f.model_name} declares parallel_plan(); declare one"
        " (see examples/own_model_plan.py), or apply TP yourself in configure_model with self.device_mesh['tp']",
        PlanError,
    ),
    *_phase(context.RULES, "setup"),
    *_phase(grid.RULES, "setup"),
    Rule(
        # Megatron sums the two uses' gradients over an embedding group of the first and last stages; we do not yet
        "pp_without_tied_parameters", "setup",
        lambda f: not f.self_parallelised and f.layout.pp > 1 and bool(_tied_names(f.owners[0].module)),
        lambda f: f"pp={f.layout.pp} with {type(f.owners[0].module).__name__}'s tied parameters"
        f" {_tied_names(f.owners[0].module)}: the embedding runs on the first pipeline stage and the output head on"
        " the last, and their gradients would have to be summed across stages (not supported yet); use pp=1 (fsdp,"
        " tp and cp work with tied embeddings), or untie them (zoo GPT: tie_embeddings=False)",
        PlanError,
    ),
)

RULES_BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}


def _tied_names(module: Any) -> list[str]:
    """Names of the parameters one module shares with another (tied embeddings: ['tok_embeddings.weight =
    output.weight']); empty for anything that is no nn.Module."""
    names: dict[int, list[str]] = {}
    for name, param in getattr(module, "named_parameters", lambda **_: ())(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [" = ".join(group) for group in names.values() if len(group) > 1]


def _tp_across_nodes(f: Facts) -> str:
    d = _node_devices(f)
    return (
        f"tp={f.layout.tp} does not divide the {d} devices of one node: tensor-parallel groups cross nodes"
        f" (their all-reduces per layer then run at {_gbps(f.topology.inter_node_bandwidth)} instead of"
        f" {_gbps(f.topology.intra_node_bandwidth)}); choose tp dividing {d}"
    )


def check(phase: Phase, facts: Facts, only: Optional[tuple[str, ...]] = None) -> None:
    """Every rule of `phase` (or only the named ones), in table order: the first broken one raises."""
    for rule in RULES:
        if rule.phase == phase and (only is None or rule.name in only):
            enforce(rule, facts)
