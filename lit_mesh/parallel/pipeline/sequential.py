"""A network held as a plain `nn.Sequential` is pipelined without a declared plan: its children are the blocks that
stages cut, balanced by parameter count (or `pp_split`, counted in children), and each stage runs its children in
order (a pruned nn.Sequential keeps its children's names, so checkpoints read the same on every layout).

Only under pp > 1 and only where no module declares `parallel_plan()`: the other techniques keep their own ways of
finding what to shard (lit_mesh/parallel/apply.py).
"""

from __future__ import annotations

from torch import nn

from lit_mesh.plan import ParallelPlan, PipelinePlan, PlanOwner, TensorPlan

SEQUENTIAL_PLAN = ParallelPlan(
    blocks="",  # the nn.Sequential's own children
    pp=PipelinePlan(balance="parameters"),
    tp=TensorPlan(
        unavailable="an nn.Sequential pipelined without a plan has no tensor-parallel plan; declare parallel_plan()"
        " with a TensorPlan on the network (see examples/own_model_plan.py), or use tp=1"
    ),
)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def sequential_owners(root: nn.Module) -> list[PlanOwner]:
    """The outermost nn.Sequential modules under `root` (root excluded) that hold parameters, each with the plan that
    cuts it by its children; the pipeline takes exactly one (lit_mesh/parallel/pipeline/rules.py)."""
    owners: list[PlanOwner] = []
    for name, module in root.named_modules():
        if not name or any(name.startswith(f"{o.name}.") for o in owners):
            continue
        if isinstance(module, nn.Sequential) and _holds_parameters(module):
            owners.append(PlanOwner(name, module, SEQUENTIAL_PLAN))
    return owners
