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

from lit_mesh import mesh
from lit_mesh.checkpoint import writer as checkpoint_writer
from lit_mesh.comm import topology
from lit_mesh.training import precision
from lit_mesh.comm import rules as compression
from lit_mesh.errors import PlanError
from lit_mesh.parallel import activation_checkpointing, data, expert, tensor
from lit_mesh.parallel import compile as torch_compile
from lit_mesh.parallel.pipeline.rules import RULES as PIPELINE_RULES
from lit_mesh.unit import Facts, Phase, Rule, divisors, enforce  # noqa: F401 - divisors, enforce re-exported


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
        "cp_needs_plan", "setup",
        lambda f: not f.self_parallelised and f.layout.cp > 1 and not f.owners,
        lambda f: f"cp={f.layout.cp} but no module of {f.model_name} declares parallel_plan() with its attention;"
        " declare one with cp=ContextPlan(attention=..., positions=...) (see zoo/gpt.py), or use cp=1",
        PlanError,
    ),
)

# The units in the order closest to that of the one table that held every rule before (within a phase the first
# broken rule raises, so this order decides which error a user sees first).
RULES: list[Rule] = [
    *mesh.RULES,
    *precision.RULES,
    *PIPELINE_RULES,  # lit_mesh/parallel/pipeline/rules.py
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




def check(phase: Phase, facts: Facts, only: Optional[tuple[str, ...]] = None) -> None:
    """Every rule of `phase` (or only the named ones), in RULES order: the first broken one raises."""
    for rule in RULES:
        if rule.phase == phase and (only is None or rule.name in only):
            enforce(rule, facts)
