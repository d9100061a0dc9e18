"""Every cross-feature rule of MeshStrategy in one table: what may combine with what, what must divide what.

A rule is data (lit_mesh/unit.py): a name, the phase that checks it, a predicate that is True when the rule is
broken, and a message with the numbers and the fix.
Single-value checks ("tp must be >= 1", "cp_style must be one of ...") stay beside the option they check.
"""

from __future__ import annotations

from typing import Any, Optional

from lit_mesh.errors import (
    CompressionConfigError,
    PlanError,
    TopologyError,
    WorldSizeError,
)
from lit_mesh.parallel.pipeline.rules import RULES as PIPELINE_RULES
from lit_mesh.unit import Facts, Phase, Rule, divisors, enforce  # noqa: F401 - divisors, enforce re-exported


def _block_options(f: Facts) -> list[str]:
    asked = {"activation_checkpointing": f.options.memory.activation_checkpointing != "none",
             "compile_blocks": f.options.compile.backend is not None}  # fmt: skip
    return [name for name, on in asked.items() if on]


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


def _gbps(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:g} GB/s"


RULES: tuple[Rule, ...] = (
    # ---- init: the arguments alone ---------------------------------------------------------------------------
    Rule(
        "one_auto_degree", "init",
        lambda f: f.degrees.get("dp") == "auto" and f.degrees.get("dp_shard") == "auto",
        lambda f: "dp='auto' and dp_shard='auto': only one degree may be 'auto'; give the other a number",
    ),
    *PIPELINE_RULES,  # lit_mesh/parallel/pipeline/rules.py
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
        # torch's PipelineStage keeps FSDP units gathered over the micro-batches and reduces once at the last one
        "zero_stage_with_pp", "init",
        lambda f: f.options.data.zero_stage != 3 and f.degrees["pp"] > 1,
        lambda f: f"zero_stage={f.options.data.zero_stage} with pp={f.degrees['pp']}: under a pipeline each stage's"
        " parameters are already gathered once per step and its gradients reduced once, at the last micro-batch"
        " (torch's PipelineStage), with parameters, gradients and optimizer state sharded between steps; zero_stage"
        " applies to pp=1 only: leave it at 3 with pp, or use pp=1",
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
        "async_tp_needs_cuda_nccl", "launch",
        lambda f: f.options.compile.async_tp and (f.device_type != "cuda" or f.process_group_backend != "nccl"),
        lambda f: f"async_tp=True on device {f.device_type!r} with process group backend"
        f" {f.process_group_backend!r}: async TP (torch's micro-pipeline TP) exchanges tiles through CUDA symmetric"
        " memory and needs accelerator='cuda' with the 'nccl' backend; on this machine set async_tp=False (plain TP,"
        " compiled or not, runs here)",
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
    Rule(
        "cp_needs_plan", "setup",
        lambda f: not f.self_parallelised and f.layout.cp > 1 and not f.owners,
        lambda f: f"cp={f.layout.cp} but no module of {f.model_name} declares parallel_plan() with its attention;"
        " declare one with cp=ContextPlan(attention=..., positions=...) (see zoo/gpt.py), or use cp=1",
        PlanError,
    ),
)

RULES_BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}


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
