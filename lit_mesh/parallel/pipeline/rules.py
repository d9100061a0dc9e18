"""The pipeline's rules (pp, its schedules, 2bw): what they combine with, by phase. lit_mesh/rules.py collects them
into its table, in this order."""

from __future__ import annotations

from typing import Any, Optional

from lit_mesh.errors import PipelineConfigError, PlanError
from lit_mesh.parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, microbatch_problem
from lit_mesh.parallel.pipeline.sequential import SEQUENTIAL_PLAN
from lit_mesh.parallel.units import choose_blocks
from lit_mesh.unit import Facts, Rule


def _schedule_kind(f: Facts) -> str:
    return SCHEDULES[f.options.pipeline.schedule][1]


def _microbatch_problem(f: Facts) -> Optional[str]:
    return microbatch_problem(f.options.pipeline, f.degrees["pp"])


def _splits_backward(f: Facts) -> bool:
    return f.options.pipeline.schedule in SPLIT_BACKWARD


def _block_options(f: Facts) -> list[str]:
    asked = {
        "activation_checkpointing": f.options.memory.activation_checkpointing != "none",
        "compile_blocks": f.options.compile.backend is not None,
    }
    return [name for name, on in asked.items() if on]


def _pipeline_options_given(p: Any) -> bool:
    return p.schedule != "1f1b" or p.microbatches is not None or p.stages_per_rank is not None or bool(p.split)


def _is_2bw(f: Facts) -> bool:
    return f.options.pipeline.schedule == "2bw" and f.degree("pp") != 1


def _beside_2bw(f: Facts) -> list[str]:
    """What the mesh combines with pp under 2bw: its driver keeps two plain weight versions per stage and steps
    them itself (twobw.py), with no sharded, tensor-parallel or reduced parameters."""
    layout = f.layout
    found = [f"{n}={getattr(layout, n)}" for n in ("tp", "cp", "ep") if getattr(layout, n) > 1]
    if layout.data_parallel != "none":
        found.append(
            f"data parallel {layout.data_parallel} (dp_replicate={layout.dp_replicate}, dp_shard={layout.dp_shard})"
        )
    return found


def _outside_the_sequential(f: Facts) -> list[str]:
    """A model without a parallel_plan() under pp > 1: its parameters outside every nn.Sequential found to cut (all
    of them when none was found). Empty where the model declares a plan or configure_model parallelised it."""
    if f.layout.pp == 1 or f.self_parallelised or f.root is None:
        return []
    if any(owner.plan is not SEQUENTIAL_PLAN for owner in f.owners):  # a declared plan: pp_needs_one_plan judges
        return []
    inside = {id(p) for owner in f.owners for p in owner.module.parameters()}
    return [name for name, p in f.root.named_parameters() if id(p) not in inside]


def _not_sequential_message(f: Facts) -> str:
    outside = _outside_the_sequential(f)
    shown = ", ".join(outside[:3]) + (f" (+{len(outside) - 3} more)" if len(outside) > 3 else "")
    blocks = choose_blocks(f.root)
    found = f" (its repeated blocks: {blocks.describe()})" if blocks.modules else ""
    return (
        f"pp={f.layout.pp}: {f.model_name} declares no parallel_plan(), and without one only a network held as one"
        f" nn.Sequential is cut into pipeline stages (by its children); {shown} lie outside any nn.Sequential{found}."
        " Declare parallel_plan() with a PipelinePlan on the network (see examples/own_model_plan.py), or hold the"
        " network as one nn.Sequential and compute the loss with lit_mesh.loss_of (examples/pipeline_sequential.py),"
        " or use pp=1"
    )


def _tied_names(module: Any) -> list[str]:
    """Names of the parameters one module shares with another (tied embeddings: ['tok_embeddings.weight =
    output.weight']); empty for anything that is no nn.Module."""
    names: dict[int, list[str]] = {}
    for name, param in getattr(module, "named_parameters", lambda **_: ())(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [" = ".join(group) for group in names.values() if len(group) > 1]


RULES: list[Rule] = [
    Rule(
        "one_stage_schedule",
        "init",
        lambda f: f.options.pipeline.stages_per_rank not in (None, 1) and _schedule_kind(f) == "one",
        lambda f: (
            f"pp_schedule={f.options.pipeline.schedule!r} runs one stage per rank, not pp_stages_per_rank="
            f"{f.options.pipeline.stages_per_rank}; use 'interleaved_1f1b', 'looped_bfs' or 'zero_bubble' for several"
        ),
        PipelineConfigError,
    ),
    Rule(
        "interleaved_schedule_stages",
        "init",
        lambda f: (f.options.pipeline.stages_per_rank or 2) < 2 and _schedule_kind(f) == "many",
        lambda f: (
            f"pp_schedule={f.options.pipeline.schedule!r} interleaves several stages per rank, but pp_stages_per_rank="
            f"{f.options.pipeline.stages_per_rank}; set pp_stages_per_rank >= 2, or use '1f1b' for one stage per rank"
        ),
        PipelineConfigError,
    ),
    Rule(
        "v_schedule_two_stages",
        "init",
        lambda f: f.options.pipeline.stages_per_rank not in (None, 2) and _schedule_kind(f) == "two",
        lambda f: (
            f"pp_schedule={f.options.pipeline.schedule!r} runs exactly 2 stages per rank (V shape), not"
            f" {f.options.pipeline.stages_per_rank}; set pp_stages_per_rank=2"
        ),
        PipelineConfigError,
    ),
    Rule(
        "pp_microbatches_for_schedule",
        "init",
        lambda f: f.degrees["pp"] > 1 and _microbatch_problem(f) is not None,
        lambda f: (
            f"pp_schedule={f.options.pipeline.schedule!r} with pp={f.degrees['pp']} and"
            f" {f.options.pipeline.n_microbatches(f.degrees['pp'])} micro-batches: it {_microbatch_problem(f)}"
        ),
        PipelineConfigError,
    ),
    Rule(
        "pp_split_per_stage",
        "init",
        lambda f: (
            f.options.pipeline.split is not None
            and len(f.options.pipeline.split) != f.degrees["pp"] * f.options.pipeline.local_stages()
        ),
        lambda f: (
            f"pp_split={list(f.options.pipeline.split)} has {len(f.options.pipeline.split)} entries but"
            f" pp={f.degrees['pp']} x stages per rank {f.options.pipeline.local_stages()} ="
            f" {f.degrees['pp'] * f.options.pipeline.local_stages()} stages; give one number of blocks per stage"
        ),
        PipelineConfigError,
    ),
    Rule(
        "pipeline_options_need_pp",
        "init",
        lambda f: f.degrees["pp"] == 1 and _pipeline_options_given(f.options.pipeline),
        lambda f: "pp_schedule, pp_microbatches, pp_stages_per_rank and pp_split need pp > 1",
        PipelineConfigError,
    ),
    Rule(
        # measured on torch 2.13: compiled blocks fail in the input-gradient pass inside AOTAutograd ("compiled with
        # non-empty donated buffers which requires ... retain_graph=False"); checkpointed blocks fail in the weight-
        # gradient pass (the composable checkpoint's recompute context is entered a second time: AttributeError)
        "split_backward_without_block_options",
        "init",
        lambda f: f.degrees["pp"] > 1 and _splits_backward(f) and bool(_block_options(f)),
        lambda f: (
            f"{_block_options(f)[0]} with pp_schedule={f.options.pipeline.schedule!r}: this schedule splits each"
            " backward into an input-gradient pass and a later weight-gradient pass over every block, but a compiled"
            " block's backward is one graph that cannot be split and a checkpointed block is recomputed only once per"
            " forward; use pp_schedule='interleaved_1f1b' (or '1f1b', 'gpipe', 'looped_bfs') with it, or turn it off"
        ),
        PipelineConfigError,
    ),
    Rule(
        # a checkpointed block recomputes its forward in backward, one step later under 2bw, from the live weights
        # (W_{t+1}) instead of the version its forward used; compiled blocks are traced against the parameters
        # that functional_call swaps for each version
        "2bw_without_block_options",
        "init",
        lambda f: _is_2bw(f) and bool(_block_options(f)),
        lambda f: (
            f"{_block_options(f)[0]} with pp_schedule='2bw': each micro-batch's backward must use the weight"
            " version its forward used, and a checkpointed or compiled block would recompute or trace with the"
            " parameters' live values; turn it off, or use pp_schedule='1f1b'"
        ),
        PipelineConfigError,
    ),
    Rule(
        # each batch's gradient is made over two steps, whose loss scales may differ (the scaler updates in between)
        "2bw_without_fp16_scaler",
        "launch",
        lambda f: _is_2bw(f) and f.precision == "16-mixed",
        lambda f: (
            "pp_schedule='2bw' with fp16 loss scaling: each batch's gradient is made over two steps, whose"
            " loss scales may differ; use precision='bf16-mixed' (no scaler needed) or pp_schedule='1f1b'"
        ),
        PipelineConfigError,
    ),
    Rule(
        "2bw_pipeline_alone",
        "launch",
        lambda f: _is_2bw(f) and bool(_beside_2bw(f)),
        lambda f: (
            f"pp_schedule='2bw' with {', '.join(_beside_2bw(f))}: PipeDream-2BW here runs pipeline parallel"
            f" alone (every rank one stage, world size = pp={f.layout.pp}), keeping two plain weight versions per stage;"
            " give pp = the world size with tp=1, cp=1, ep=1 and no dp, or use pp_schedule='1f1b' to combine them"
        ),
        PipelineConfigError,
    ),
    Rule(
        "self_parallelised_without_pp",
        "setup",
        lambda f: f.self_parallelised and f.layout.pp > 1,
        lambda f: (
            f"pp={f.layout.pp}: configure_model parallelised the model itself, so MeshStrategy cannot cut it"
            " into pipeline stages; declare a parallel_plan() instead, or use pp=1"
        ),
    ),
    Rule(
        "pp_without_plan_needs_one_sequential",
        "setup",
        lambda f: bool(_outside_the_sequential(f)),
        _not_sequential_message,
        PlanError,
    ),
    Rule(
        "pp_needs_one_plan",
        "setup",
        lambda f: not f.self_parallelised and f.layout.pp > 1 and len(f.owners) != 1,
        lambda f: (
            f"pp > 1 pipelines one model that declares parallel_plan() (or, without one, one nn.Sequential);"
            f" {f.model_name} has {[o.name for o in f.owners] or 'none'}. Declare a plan on the network (see"
            " examples/own_model_plan.py), hold it as one nn.Sequential (examples/pipeline_sequential.py), or use pp=1"
        ),
        PlanError,
    ),
    Rule(
        # a dense plan without the modules before and after its blocks (a transformers base model, ViT): no stages
        "pp_needs_stage_plan",
        "setup",
        lambda f: (
            not f.self_parallelised
            and f.layout.pp > 1
            and bool(f.owners)
            and bool(f.owners[0].plan.blocks)  # a plain nn.Sequential is cut by its children, without them
            and f.owners[0].plan.moe is None
            and not (f.owners[0].plan.pp.first or f.owners[0].plan.pp.last)
        ),
        lambda f: (
            f"pp={f.layout.pp} with {type(f.owners[0].module).__name__}: its plan declares no PipelinePlan (the"
            " modules before and after the blocks), so it cannot be cut into stages; pipeline a causal LM (Llama,"
            " Qwen2, Mistral, GPT-2 *ForCausalLM / LMHeadModel), declare pp=PipelinePlan(first=..., last=...) in"
            " its parallel_plan(), or use pp=1"
        ),
        PlanError,
    ),
    Rule(
        "pp_moe_needs_stage_plan",
        "setup",
        lambda f: (
            not f.self_parallelised
            and f.layout.pp > 1
            and f.owners[0].plan.moe is not None
            and not (f.owners[0].plan.pp.first or f.owners[0].plan.pp.last)
        ),
        lambda f: (
            f"pp={f.layout.pp} with the MoE model {type(f.owners[0].module).__name__}: its parallel_plan()"
            " declares no PipelinePlan (the modules before and after the blocks), so it cannot be cut into stages;"
            " declare pp=PipelinePlan(first=..., last=...) as zoo/moe.py does, or use pp=1 (ep, dp, tp and cp work"
            " with MoE)"
        ),
        PlanError,
    ),
    Rule(
        # MoE under pp carries router statistics and expert reductions through torch's schedule steps
        "2bw_without_moe",
        "setup",
        lambda f: not f.self_parallelised and _is_2bw(f) and bool(f.owners) and f.owners[0].plan.moe is not None,
        lambda f: (
            f"pp_schedule='2bw' with the MoE model {type(f.owners[0].module).__name__}: the 2bw driver does not"
            " carry MoE routing statistics or auxiliary losses across its delayed steps; use pp_schedule='1f1b' with MoE"
        ),
        PipelineConfigError,
    ),
    Rule(
        # the other schedules sum the tied copies' gradients after their step (tied.py); 2bw steps its own weights
        "2bw_without_tied_parameters",
        "setup",
        lambda f: not f.self_parallelised and _is_2bw(f) and bool(f.owners) and bool(_tied_names(f.owners[0].module)),
        lambda f: (
            f"pp_schedule='2bw' with {type(f.owners[0].module).__name__}'s tied parameters"
            f" {_tied_names(f.owners[0].module)}: the embedding runs on the first pipeline stage and the output head on"
            " the last, and the 2bw driver's delayed weight versions cannot sum their gradients between the stages;"
            " use another pp_schedule (1f1b, gpipe, interleaved_1f1b, ...), or untie them (zoo GPT:"
            " tie_embeddings=False)"
        ),
        PipelineConfigError,
    ),
    Rule(
        # V placement puts the first and the last stage on one rank, each stage its own FSDP root: one parameter
        # cannot be sharded by two roots
        "v_placement_fsdp_without_tied_parameters",
        "setup",
        lambda f: (
            not f.self_parallelised
            and f.layout.pp > 1
            and f.options.pipeline.placement == "v"
            and f.layout.data_parallel in ("fsdp", "hsdp")
            and bool(f.owners)
            and bool(_tied_names(f.owners[0].module))
        ),
        lambda f: (
            f"pp_schedule={f.options.pipeline.schedule!r} places the first and the last stage on one rank, and"
            f" {type(f.owners[0].module).__name__}'s tied parameters {_tied_names(f.owners[0].module)} would be"
            f" sharded by both stages' FSDP ({f.layout.data_parallel}); use a looped schedule (1f1b, gpipe,"
            " interleaved_1f1b), dp_shard=1, or untie them (zoo GPT: tie_embeddings=False)"
        ),
        PipelineConfigError,
    ),
]
