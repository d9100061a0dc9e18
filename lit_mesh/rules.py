"""Every cross-feature rule of MeshStrategy, collected from the units that own them: what may combine with what,
what must divide what.

A rule is data (lit_mesh/unit.py): a name, the phase that checks it, a predicate that is True when the rule is
broken, and a message with the numbers and the fix. Each unit declares its own (`RULES` in its module), a
cross-feature rule in the unit of the technique that adds the constraint; single-value checks ("tp must be >= 1",
"cp_style must be one of ...") stay beside the option they check (its dataclass's __post_init__).
This module only collects them, in one order: within a phase, the first broken rule raises.
"""

from __future__ import annotations

from typing import Any, Optional

from lit_mesh import checkpoint_writer, mesh, precision, topology
from lit_mesh.comm import rules as compression
from lit_mesh.errors import PipelineConfigError, PlanError
from lit_mesh.parallel import activation_checkpointing, data, expert, tensor
from lit_mesh.parallel import compile as torch_compile
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

def _grid_problem(f: Facts, tp: Any) -> Optional[str]:
    """Why `tp` ranks do not form the grid of the chosen tp_mode (None: they do, or tp_mode is "1d")."""
    from lit_mesh.parallel.tensor_grid import fits_grid, grid_sizes_near

    mode, depth = f.options.tensor.mode, f.options.tensor.depth
    if mode == "1d" or not isinstance(tp, int) or fits_grid(tp, mode, depth):
        return None
    need = {"2d": "tp = q * q (a q x q grid)", "2.5d": f"tp = d * q * q with d = tp_depth = {depth or 1}",
            "3d": "tp = q * q * q (a q x q x q grid)"}[mode]  # fmt: skip
    return f"tp_mode={mode!r} needs {need}, but tp={tp}; use tp in {grid_sizes_near(tp, mode, depth)[:6]}"


def _grid_conflicts(f: Facts) -> list[str]:
    """The options a grid tp_mode does not combine with, as given."""
    o = f.options
    asked = {f"pp={f.degrees.get('pp')}": f.degrees.get("pp", 1) > 1, f"cp={f.degrees.get('cp')}": f.degrees.get("cp", 1) > 1,
             f"ep={f.degrees.get('ep')}": f.degrees.get("ep", 1) > 1, "sequence_parallel=True": o.mesh.sequence_parallel,
             "compile_blocks=True": o.compile.backend is not None, "async_tp=True": o.compile.async_tp,
             f"activation_checkpointing={o.memory.activation_checkpointing!r}": o.memory.activation_checkpointing != "none",
             "grad_compression": o.communication.compression is not None,
             "allreduce='hierarchical'": o.communication.allreduce == "hierarchical"}  # fmt: skip
    return [name for name, on in asked.items() if on]


def _grid_schemes() -> list[str]:
    from lit_mesh.parallel.tensor_nd import SCHEMES

    return sorted(SCHEMES)


def _grid_scheme_missing(f: Facts) -> bool:
    return f.options.tensor.mode != "1d" and f.options.tensor.mode not in _grid_schemes()


def _node_devices(f: Facts) -> int:
    return f.topology.devices_per_node


# The pipeline/2bw, grid-TP and CP rules, in today's order, until their units hold them (parallel/pipeline/rules.py,
# parallel/grid/rules.py, parallel/context/rules.py).
_NOT_YET_IN_THEIR_UNITS: tuple[Rule, ...] = (
    # ---- init: the arguments alone ---------------------------------------------------------------------------
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
    Rule(
        "tp_mode_has_scheme", "init",
        _grid_scheme_missing,
        lambda f: f"tp_mode={f.options.tensor.mode!r} has no implementation in this version; use one of"
        f" {['1d', *_grid_schemes()]}",
    ),
    Rule(
        "tp_grid_shape", "init",
        lambda f: _grid_problem(f, f.degrees.get("tp")) is not None,
        lambda f: _grid_problem(f, f.degrees.get("tp")),
    ),
    Rule(
        # the grid schemes split the batch and the features of every activation themselves; the techniques below
        # assume 1-D TP's layout (or split the same dims again) and are not wired to the grid
        "tp_grid_alone", "init",
        lambda f: f.options.tensor.mode != "1d" and bool(_grid_conflicts(f)),
        lambda f: f"tp_mode={f.options.tensor.mode!r} with {', '.join(_grid_conflicts(f))}: the grid tensor-parallel"
        " schemes combine with dp_replicate (DDP) only here; drop those (sequence_parallel=False: the grid splits the"
        " batch, not the sequence), or use tp_mode='1d' with them",
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
        "tp_grid_shape_resolved", "launch",  # tp="auto" (the devices of a node) resolved
        lambda f: _grid_problem(f, f.layout.tp) is not None,
        lambda f: _grid_problem(f, f.layout.tp),
    ),
    Rule(
        # sharded data parallelism runs on FSDP2, which does not take parameters that are DTensors on the grid's mesh;
        # replicas (DDP) average their gradients with hooks of the grid's own (lit_mesh/parallel/tensor_nd.py)
        "tp_grid_without_sharded_dp", "launch",
        lambda f: f.options.tensor.mode != "1d" and f.layout.data_parallel in ("fsdp", "hsdp"),
        lambda f: f"tp_mode={f.options.tensor.mode!r} with sharded data parallelism ({f.layout.describe()}): the grid"
        f" schemes combine with replicas only; use dp_replicate={f.layout.dp} (DDP) instead of dp/dp_shard, or"
        " tp_mode='1d' with FSDP",
    ),
    Rule(
        "cp_tp_inside_node", "launch",
        lambda f: _node_devices(f) % f.layout.tp == 0 and _node_devices(f) % (f.layout.tp * f.layout.cp) != 0,
        lambda f: f"cp={f.layout.cp} x tp={f.layout.tp} = {f.layout.cp * f.layout.tp} does not divide the"
        f" {_node_devices(f)} devices of one node: context-parallel groups cross nodes; choose cp x tp dividing"
        f" {_node_devices(f)}",
        warn_only=True,
    ),
    # ---- setup: the model ----------------------------------------------------------------------------------------
    Rule(
        "self_parallelised_without_pp", "setup",
        lambda f: f.self_parallelised and f.layout.pp > 1,
        lambda f: f"pp={f.layout.pp}: configure_model parallelised the model itself, so MeshStrategy cannot cut it"
        " into pipeline stages; declare a parallel_plan() instead, or use pp=1",
    ),
    Rule(
        # the strategy shards batches over cp; without a plan applied, attention would see only its shard
        "self_parallelised_without_cp", "setup",
        lambda f: f.self_parallelised and f.layout.cp > 1,
        lambda f: f"cp={f.layout.cp} but configure_model of {f.model_name} parallelised the model itself, so"
        " MeshStrategy applies no plan and cannot make its attention span the cp ranks (it would see only its"
        " shard of the sequence); use cp=1, or leave parallelisation to a parallel_plan() that declares"
        " attention and positions",
        PlanError,
    ),
    Rule(
        "self_parallelised_without_tp_grid", "setup",
        lambda f: f.self_parallelised and f.options.tensor.mode != "1d",
        lambda f: f"tp_mode={f.options.tensor.mode!r} is applied by MeshStrategy from a parallel_plan(), but"
        f" configure_model of {f.model_name} parallelised the model itself; declare a plan, or use tp_mode='1d'",
        PlanError,
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
        "cp_needs_plan", "setup",
        lambda f: not f.self_parallelised and f.layout.cp > 1 and not f.owners,
        lambda f: f"cp={f.layout.cp} but no module of {f.model_name} declares parallel_plan() with its attention;"
        " declare one with cp=ContextPlan(attention=..., positions=...) (see zoo/gpt.py), or use cp=1",
        PlanError,
    ),
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

# The units in the order closest to that of the one table that held every rule before (within a phase the first
# broken rule raises, so this order decides which error a user sees first).
RULES: list[Rule] = [
    *mesh.RULES,
    *precision.RULES,
    *_NOT_YET_IN_THEIR_UNITS,
    *torch_compile.RULES,
    *data.RULES,
    *checkpoint_writer.RULES,
    *compression.RULES,
    *topology.RULES,
    *activation_checkpointing.RULES,
    *tensor.RULES,
    *expert.RULES,
]
RULES_BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}


def _tied_names(module: Any) -> list[str]:
    """Names of the parameters one module shares with another (tied embeddings: ['tok_embeddings.weight =
    output.weight']); empty for anything that is no nn.Module."""
    names: dict[int, list[str]] = {}
    for name, param in getattr(module, "named_parameters", lambda **_: ())(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [" = ".join(group) for group in names.values() if len(group) > 1]


def check(phase: Phase, facts: Facts, only: Optional[tuple[str, ...]] = None) -> None:
    """Every rule of `phase` (or only the named ones), in RULES order: the first broken one raises."""
    for rule in RULES:
        if rule.phase == phase and (only is None or rule.name in only):
            enforce(rule, facts)
