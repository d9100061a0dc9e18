"""Which blocks each pipeline stage holds, which rank runs each stage, and the per-stage views of a model.

Pure bookkeeping, no communication: runner.py beside it builds the schedule on top of it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn

from lit_mesh.errors import PipelineConfigError  # noqa: F401 - re-exported
from lit_mesh.plan import ParallelPlan

Placement = Literal["loop", "v"]


def balanced_split(n_blocks: int, n_stages: int) -> list[int]:
    """Blocks per stage, contiguous, balancing a cost in which the first stage's embedding and the last
    stage's output head each count as one block (so the outer stages get one block fewer)."""
    if n_stages > n_blocks:
        raise PipelineConfigError(
            f"{n_stages} pipeline stages but the model has {n_blocks} blocks: every stage needs at least one;"
            f" choose pp x pp_stages_per_rank <= {n_blocks}"
        )
    if n_stages == 1:
        return [n_blocks]
    extra = [1] + [0] * (n_stages - 2) + [1]  # embedding on the first stage, head on the last
    units = n_blocks + 2
    # smallest per-stage cost that lets every stage hold >= 1 block, then fill greedily from the front
    for cap in range(-(-units // n_stages), units + 1):
        counts, left = [], n_blocks
        for stage in range(n_stages):
            stages_after = n_stages - stage - 1
            take = min(cap - extra[stage], left - stages_after)
            if take < 1:
                break
            counts.append(take)
            left -= take
        if len(counts) == n_stages and left == 0:
            return counts
    raise AssertionError("unreachable: cap = units always fits")


def parameter_balanced_split(sizes: Sequence[int], n_stages: int) -> list[int]:
    """Blocks per stage, contiguous, making the largest stage's parameter count as small as it can be (`sizes`: the
    blocks' parameter counts). A stage begins only at a block with parameters: parameter-free blocks (activations,
    pooling, flattening) stay with the block before them, where the data they act on is."""
    # units: a block with parameters and the parameter-free blocks after it (leading ones join the first unit)
    unit_starts = [0] + [i for i, size in enumerate(sizes) if size > 0][1:]
    if n_stages > len(unit_starts):
        raise PipelineConfigError(
            f"{n_stages} pipeline stages but the model has {len(unit_starts)} block(s) with parameters to start them"
            f" ({len(sizes)} blocks in all); choose pp x pp_stages_per_rank <= {len(unit_starts)}, or give pp_split"
        )
    bounds = [*unit_starts, len(sizes)]
    units = [sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])]

    def fill(cap: int) -> list[int] | None:
        """Units per stage, each stage taking as many as fit under `cap` while leaving one for every later stage."""
        counts, at = [], 0
        for stage in range(n_stages):
            stages_after, took, cost = n_stages - stage - 1, 0, 0
            while at + took < len(units) - stages_after and (took == 0 or cost + units[at + took] <= cap):
                cost += units[at + took]
                took += 1
            if cost > cap:
                return None
            counts.append(took)
            at += took
        return counts if at == len(units) else None

    low, high = max(units), sum(units)  # the smallest cap that fits: a binary search (fill is monotone in cap)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if fill(middle) is not None else (middle + 1, high)
    per_stage = fill(low)
    assert per_stage is not None, "the sum of all units always fits"
    starts = [sum(per_stage[:s]) for s in range(n_stages)]
    return [bounds[start + n] - bounds[start] for start, n in zip(starts, per_stage)]


def check_split(split: Sequence[int], n_blocks: int, n_stages: int) -> list[int]:
    """An explicit split (blocks per stage) must have one entry per stage and cover every block once."""
    split = list(split)
    if len(split) != n_stages:
        raise PipelineConfigError(
            f"pp_split={split} has {len(split)} entries but there are {n_stages} stages (pp x pp_stages_per_rank);"
            f" give {n_stages} numbers of blocks"
        )
    if any(n < 1 for n in split) or sum(split) != n_blocks:
        raise PipelineConfigError(
            f"pp_split={split} must give every stage >= 1 block and add up to the model's {n_blocks} blocks"
            f" (it adds up to {sum(split)})"
        )
    return split


def stage_ranks(n_stages: int, pp: int, placement: Placement) -> list[int]:
    """The pp rank that runs each stage: looped (stage s on s mod pp) or V (rank r runs r and 2pp-1-r)."""
    if placement == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


@dataclass
class Stage:
    """One pipeline stage on this rank: its index and the module that runs it."""

    index: int
    module: nn.Module


def _view(module: nn.Module) -> nn.Module:
    """A shallow copy that shares every submodule and parameter but has registries and hooks of its own,
    so a stage can drop modules and FSDP can hook it without touching the original."""
    view = copy.copy(module)
    for name, value in vars(view).items():
        if isinstance(value, (dict, set)):
            setattr(view, name, copy.copy(value))
    return view


class _Identity(nn.Identity):
    """Stands in for a module a stage does not hold, passing its input on (a final norm, a head)."""

    pipeline_stand_in = True  # what tensor parallelism leaves alone (lit_mesh/parallel/tensor.py)


class _Zeros(nn.Module):
    """Stands in for a module whose output the model adds (GPT-2's position embeddings) on a stage without it."""

    pipeline_stand_in = True

    def forward(self, *_args: object, **_kwargs: object) -> torch.Tensor:
        return torch.zeros(())


_STAND_INS: dict[str, type[nn.Module]] = {"identity": _Identity, "zeros": _Zeros}


def _set_child(module: nn.Module, dotted: str, value: nn.Module | None, own_parents: bool) -> None:
    """Set the submodule at `dotted` to `value`; `own_parents`: first give `module` views of the parents on the way
    (a stage view must not change the modules it shares with the model and the other views)."""
    *path, leaf = dotted.split(".")
    parent = module
    for name in path:
        child = parent._modules[name]
        assert child is not None, f"{dotted}: its parent {name!r} was dropped"
        if own_parents:
            child = _view(child)
            parent._modules[name] = child
        parent = child
    parent._modules[leaf] = value


def _keep_blocks(module: nn.Module, blocks_attr: str, keep: set[int], own_parents: bool) -> None:
    if not blocks_attr:  # an nn.Sequential whose own children are the blocks: it keeps its stage's, by their names
        module._modules = {name: child for i, (name, child) in enumerate(module._modules.items()) if i in keep}
        return
    blocks = cast(nn.ModuleList, module.get_submodule(blocks_attr))  # the plan's blocks: a ModuleList
    kept = nn.ModuleList()
    # keep the original indices as names ("layers.5" stays "layers.5" on every layout), so checkpoints and
    # layout-independent init see the same names; ModuleList iterates its _modules in order
    kept._modules = {name: block for i, (name, block) in enumerate(blocks._modules.items()) if i in keep}
    _set_child(module, blocks_attr, kept, own_parents)


def split_into_stages(
    model: nn.Module, plan: ParallelPlan, split: list[int], ranks: list[int], pp_rank: int
) -> list[Stage]:
    """Prune `model` in place to what this pp rank runs, and return one view per local stage.

    With one stage per rank the stage is the model itself; with several (interleaved, V schedules) each
    stage is a view sharing the model's modules, and the model keeps the union (for the optimizer and
    checkpoints, under the original parameter names). A plan's `stage` makes the module that runs each.
    """
    starts = [sum(split[:s]) for s in range(len(split))]
    local = [s for s, r in enumerate(ranks) if r == pp_rank]
    last = len(split) - 1

    def blocks_of(stage: int) -> set[int]:
        return set(range(starts[stage], starts[stage] + split[stage]))

    def outer_modules(stage: int) -> set[str]:
        return (set(plan.pp.first) if stage == 0 else set()) | (set(plan.pp.last) if stage == last else set())

    def prune(module: nn.Module, stages: list[int], own_parents: bool) -> None:
        _keep_blocks(module, plan.blocks, set().union(*(blocks_of(s) for s in stages)), own_parents)
        keep = set().union(*(outer_modules(s) for s in stages))
        for name in (*plan.pp.first, *plan.pp.last):
            if name not in keep:
                stand_in = plan.pp.stand_ins.get(name)
                _set_child(module, name, _STAND_INS[stand_in]() if stand_in else None, own_parents)

    def running(module: nn.Module) -> nn.Module:
        return plan.pp.stage(module) if plan.pp.stage is not None else module

    if len(local) == 1:
        prune(model, local, own_parents=False)
        return [Stage(local[0], running(model))]
    views = []
    for stage in local:
        view = _view(model)
        prune(view, [stage], own_parents=True)
        views.append(Stage(stage, running(view)))
    prune(model, local, own_parents=False)
    return views


def global_positions(shard: torch.Tensor, shards: int) -> torch.Tensor:
    """The positions (T,) of the whole sequence whose hidden states (batch, T / shards, ...) `shard` is one shard of:
    what a stage after the first needs under sequence parallelism, where it receives its tp rank's shard."""
    return torch.arange(shard.shape[1] * shards, device=shard.device)


def pass_global_positions(stage: nn.Module, keyword: str, tp: int) -> None:
    """Under sequence parallelism a stage after the first receives its tp rank's shard of the sequence, so the
    model cannot count the positions itself: give them (0 .. T-1 of the whole sequence) as `keyword`."""

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if keyword not in kwargs:
            kwargs[keyword] = global_positions(args[0], tp)
        return args, kwargs

    stage.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
