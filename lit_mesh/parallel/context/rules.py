"""What context parallelism combines with: the CP unit's rules (collected, in the table's order, by
lit_mesh/rules.py). The value of cp_style alone is checked by ContextOptions (layout.py)."""

from __future__ import annotations

from lit_mesh.errors import PlanError
from lit_mesh.parallel.context.apply import cp_plan_problem
from lit_mesh.unit import Facts, Rule


def _node_devices(f: Facts) -> int:
    return f.topology.devices_per_node


def _plan_problems(f: Facts) -> list[str]:
    problems = (cp_plan_problem(o.plan, f.layout.cp, type(o.module).__name__) for o in f.owners)
    return [problem for problem in problems if problem is not None]


RULES: list[Rule] = [
    # ---- launch: the resolved layout and the topology -------------------------------------------------------------
    Rule(
        "cp_tp_inside_node",
        "launch",
        lambda f: _node_devices(f) % f.layout.tp == 0 and _node_devices(f) % (f.layout.tp * f.layout.cp) != 0,
        lambda f: (
            f"cp={f.layout.cp} x tp={f.layout.tp} = {f.layout.cp * f.layout.tp} does not divide the"
            f" {_node_devices(f)} devices of one node: context-parallel groups cross nodes; choose cp x tp dividing"
            f" {_node_devices(f)}"
        ),
        warn_only=True,
    ),
    # ---- setup: the model ----------------------------------------------------------------------------------------
    Rule(
        # the strategy shards batches over cp; without a plan applied, attention would see only its shard
        "self_parallelised_without_cp",
        "setup",
        lambda f: f.self_parallelised and f.layout.cp > 1,
        lambda f: (
            f"cp={f.layout.cp} but configure_model of {f.model_name} parallelised the model itself, so"
            " MeshStrategy applies no plan and cannot make its attention span the cp ranks (it would see only its"
            " shard of the sequence); use cp=1, or leave parallelisation to a parallel_plan() that declares"
            " attention and positions"
        ),
        PlanError,
    ),
    Rule(
        "cp_needs_plan",
        "setup",
        lambda f: not f.self_parallelised and f.layout.cp > 1 and not f.owners,
        lambda f: (
            f"cp={f.layout.cp} but no module of {f.model_name} declares parallel_plan() with its attention;"
            " declare one with cp=ContextPlan(attention=..., positions=...) (see zoo/gpt.py), or use cp=1"
        ),
        PlanError,
    ),
    Rule(
        # CP swaps the attention a plan names and passes each rank the global positions of its tokens
        "cp_fits_plan",
        "setup",
        lambda f: not f.self_parallelised and f.layout.cp > 1 and bool(_plan_problems(f)),
        lambda f: _plan_problems(f)[0],
        PlanError,
    ),
]
