"""What the grid tp_modes ("2d", "2.5d", "3d") combine with, and what their grid must divide: the grid unit's rules
(collected, in the table's order, by lit_mesh/rules.py). The values of tp_mode and tp_depth alone are checked by
check_tp_mode (grid.py)."""

from __future__ import annotations

from typing import Any, Optional

from lit_mesh.errors import PlanError
from lit_mesh.parallel.grid.apply import grid_plan_problem
from lit_mesh.parallel.grid.grid import fits_grid, grid_shape, grid_sizes_near
from lit_mesh.parallel.grid.schemes import SCHEMES
from lit_mesh.unit import Facts, Rule


def _grid_problem(f: Facts, tp: Any) -> Optional[str]:
    """Why `tp` ranks do not form the grid of the chosen tp_mode (None: they do, or tp_mode is "1d")."""
    mode, depth = f.options.tensor.mode, f.options.tensor.depth
    if mode == "1d" or not isinstance(tp, int) or fits_grid(tp, mode, depth):
        return None
    need = {
        "2d": "tp = q * q (a q x q grid)",
        "2.5d": f"tp = d * q * q with d = tp_depth = {depth or 1}",
        "3d": "tp = q * q * q (a q x q x q grid)",
    }[mode]
    return f"tp_mode={mode!r} needs {need}, but tp={tp}; use tp in {grid_sizes_near(tp, mode, depth)[:6]}"


def _grid_conflicts(f: Facts) -> list[str]:
    """The options a grid tp_mode does not combine with, as given."""
    o = f.options
    asked = {
        f"pp={f.degrees.get('pp')}": f.degrees.get("pp", 1) > 1,
        f"cp={f.degrees.get('cp')}": f.degrees.get("cp", 1) > 1,
        f"ep={f.degrees.get('ep')}": f.degrees.get("ep", 1) > 1,
        "sequence_parallel=True": o.mesh.sequence_parallel,
        "compile_blocks=True": o.compile.backend is not None,
        "async_tp=True": o.compile.async_tp,
        f"activation_checkpointing={o.memory.activation_checkpointing!r}": o.memory.activation_checkpointing != "none",
        "grad_compression": o.communication.compression is not None,
        "allreduce='hierarchical'": o.communication.allreduce == "hierarchical",
    }
    return [name for name, on in asked.items() if on]


def _grid_schemes() -> list[str]:
    return sorted(SCHEMES)


def _grid_scheme_missing(f: Facts) -> bool:
    return f.options.tensor.mode != "1d" and f.options.tensor.mode not in _grid_schemes()


def _applies(f: Facts) -> bool:
    """A grid tp_mode applies: tp > 1 with a grid tp_mode, on a model MeshStrategy parallelises."""
    return not f.self_parallelised and f.layout.tp > 1 and f.options.tensor.mode != "1d"


def _plan_problems(f: Facts) -> list[str]:
    mode, depth = f.options.tensor.mode, f.options.tensor.depth
    shape = grid_shape(f.layout.tp, mode, depth)
    if shape is None:  # "tp_grid_shape_resolved" refused it at launch
        return []
    problems = (grid_plan_problem(o.module, o.plan, mode, *shape) for o in f.owners)
    return [problem for problem in problems if problem is not None]


def _outside_owners(f: Facts) -> list[str]:
    """Parameters of the LightningModule outside every plan owner: DDP beside the grid averages only the owners'."""
    planned = {id(p) for o in f.owners for p in o.module.parameters()}
    return [n for n, p in f.root.named_parameters() if id(p) not in planned]


RULES: list[Rule] = [
    # ---- init: the arguments alone -------------------------------------------------------------------------------
    Rule(
        "tp_mode_has_scheme",
        "init",
        _grid_scheme_missing,
        lambda f: (
            f"tp_mode={f.options.tensor.mode!r} has no implementation in this version; use one of"
            f" {['1d', *_grid_schemes()]}"
        ),
    ),
    Rule(
        "tp_grid_shape",
        "init",
        lambda f: _grid_problem(f, f.degrees.get("tp")) is not None,
        lambda f: _grid_problem(f, f.degrees.get("tp")) or "",  # only called when broken: never None then
    ),
    Rule(
        # the grid schemes split the batch and the features of every activation themselves; the techniques below
        # assume 1-D TP's layout (or split the same dims again) and are not wired to the grid
        "tp_grid_alone",
        "init",
        lambda f: f.options.tensor.mode != "1d" and bool(_grid_conflicts(f)),
        lambda f: (
            f"tp_mode={f.options.tensor.mode!r} with {', '.join(_grid_conflicts(f))}: the grid tensor-parallel"
            " schemes combine with dp_replicate (DDP) only here; drop those (sequence_parallel=False: the grid splits the"
            " batch, not the sequence), or use tp_mode='1d' with them"
        ),
    ),
    # ---- launch: the resolved layout -----------------------------------------------------------------------------
    Rule(
        "tp_grid_shape_resolved",
        "launch",  # tp="auto" (the devices of a node) resolved
        lambda f: _grid_problem(f, f.layout.tp) is not None,
        lambda f: _grid_problem(f, f.layout.tp) or "",  # only called when broken: never None then
    ),
    Rule(
        # sharded data parallelism runs on FSDP2, which does not take parameters that are DTensors on the grid's mesh;
        # replicas (DDP) average their gradients with hooks of the grid's own (apply.py, average_over_replicas)
        "tp_grid_without_sharded_dp",
        "launch",
        lambda f: f.options.tensor.mode != "1d" and f.layout.data_parallel in ("fsdp", "hsdp"),
        lambda f: (
            f"tp_mode={f.options.tensor.mode!r} with sharded data parallelism ({f.layout.describe()}): the grid"
            f" schemes combine with replicas only; use dp_replicate={f.layout.dp} (DDP) instead of dp/dp_shard, or"
            " tp_mode='1d' with FSDP"
        ),
    ),
    # ---- setup: the model ----------------------------------------------------------------------------------------
    Rule(
        "self_parallelised_without_tp_grid",
        "setup",
        lambda f: f.self_parallelised and f.options.tensor.mode != "1d",
        lambda f: (
            f"tp_mode={f.options.tensor.mode!r} is applied by MeshStrategy from a parallel_plan(), but"
            f" configure_model of {f.model_name} parallelised the model itself; declare a plan, or use tp_mode='1d'"
        ),
        PlanError,
    ),
    Rule(
        # the grid splits the sizes a plan names and every grid linear's features into q blocks; it splits the
        # embedding over the hidden dim and replicates the head, so they cannot share one matrix
        "tp_grid_fits_plan",
        "setup",
        lambda f: _applies(f) and bool(_plan_problems(f)),
        lambda f: _plan_problems(f)[0],
        PlanError,
    ),
    Rule(
        # a parameter outside the plan owners gets no average over the replicas and would drift apart between them
        "tp_grid_replicas_need_planned_parameters",
        "setup",
        lambda f: _applies(f) and f.layout.dp_replicate > 1 and bool(_outside_owners(f)),
        lambda f: (
            f"tp_mode={f.options.tensor.mode!r} with dp_replicate: parameters {_outside_owners(f)[:4]} are"
            " outside the modules that declare a parallel_plan(); move them into it, or use dp=1"
        ),
        PlanError,
    ),
]
