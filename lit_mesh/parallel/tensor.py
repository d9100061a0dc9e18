"""Tensor and sequence parallelism: a ParallelPlan's TP styles -> torch's ParallelStyles on the tp mesh."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lit_mesh.errors import PlanError  # noqa: F401 - re-exported (lit_mesh.PlanError)
from lit_mesh.init import retie, tied_parameters
from lit_mesh.parallel.hidden_states import HiddenStatesLayout
from lit_mesh.parallel.vocab_embedding import VocabShardedEmbedding
from lit_mesh.plan import ParallelPlan
from lit_mesh.unit import Facts, Rule, divisors


def torch_style(style: str, sequence_parallel: bool, check: Any = None) -> ParallelStyle | None:
    """The torch ParallelStyle for one plan style; None where the style is a no-op without SP.

    `check(sequence_length)` guards the styles that shard the sequence of a replicated input.
    """
    sequence = Shard(1)  # activations are (batch, sequence, features)
    between_blocks = sequence if sequence_parallel else Replicate()
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=between_blocks)
    if style == "embedding":
        return VocabShardedEmbedding(input_layouts=Replicate(), output_layouts=between_blocks)
    if style == "embedding_whole_output":
        return VocabShardedEmbedding(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "head":
        return ColwiseParallel(input_layouts=between_blocks, output_layouts=Replicate(), use_local_output=True)
    if style == "vocab_head":  # loss parallel: the logits are never gathered (lit_mesh/loss.py)
        return ColwiseParallel(input_layouts=between_blocks, output_layouts=Shard(-1), use_local_output=False)
    if style == "gather_input":
        # one gather of the region's input (SP), handed on as a DTensor so that its column-wise linears' input
        # gradients are summed before one reduce-scatter (SP) or all-reduce, not reduced once per linear
        return HiddenStatesLayout(between_blocks, Replicate(), keep_dtensor=True)
    if style == "heads_norm":  # the local heads are a shard of dim 2: torch's SP style, over the heads
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        return None  # the styles below only move activations in and out of the SP region
    if style == "norm":
        return SequenceParallel()
    if style == "whole_sequence":
        return PrepareModuleInputOutput(
            input_layouts=(sequence,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(sequence,),
            use_local_output=True,
        )
    if style == "sequence_shard":  # the module's input is already this rank's sequence shard: no gather
        return PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(sequence,), use_local_output=True)
    if style == "token_wise":  # (tokens, features): this rank's tokens are a shard of dim 0
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if style == "shard_output":
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=sequence, use_local_output=True)
    if style == "shard_input":
        return HiddenStatesLayout(Replicate(), sequence, check)
    raise PlanError(f"unknown TP style {style!r}")


def tp_divides_problem(plan: ParallelPlan, tp: int, model_name: str) -> Optional[str]:
    """Which size of the model `tp` does not divide (None: it divides every size the plan names)."""
    for what, size in plan.tp.divides.items():
        if size % tp:
            choices = [d for d in divisors(size) if d <= 64]
            return f"tp={tp} does not divide {what}={size} of {model_name} (choose tp in {choices})"
    return None


def tp_plan_problem(plan: ParallelPlan, tp: int, model_name: str) -> Optional[str]:
    """Why `tp` ranks cannot split a model with this plan (None: they can)."""
    if plan.tp.unavailable:
        return f"tp={tp}: {plan.tp.unavailable}"
    return tp_divides_problem(plan, tp, model_name)


def check_tp_divides(plan: ParallelPlan, tp: int, model_name: str) -> None:
    problem = tp_divides_problem(plan, tp, model_name)
    if problem is not None:
        raise PlanError(problem)


def _plan_problems(f: Facts) -> list[str]:
    problems = (tp_plan_problem(o.plan, f.layout.tp, type(o.module).__name__) for o in f.owners)
    return [problem for problem in problems if problem is not None]


def _one_d(f: Facts) -> bool:
    """1-D TP applies: tp > 1 with tp_mode "1d" on a model MeshStrategy parallelises."""
    return not f.self_parallelised and f.layout.tp > 1 and f.options.tensor.mode == "1d"


RULES: list[Rule] = [
    Rule(
        "tp_needs_plan",
        "setup",
        lambda f: not f.self_parallelised and f.layout.tp > 1 and not f.owners,
        lambda f: (
            f"tp={f.layout.tp} but no module of {f.model_name} declares parallel_plan(); declare one"
            " (see examples/own_model_plan.py), or apply TP yourself in configure_model with self.device_mesh['tp']"
        ),
        PlanError,
    ),
    Rule(
        # the sizes a plan names (heads, hidden units, vocabulary) must split evenly; a plan may say why a model
        # cannot be split at all (TensorPlan.unavailable)
        "tp_fits_plan",
        "setup",
        lambda f: _one_d(f) and bool(_plan_problems(f)),
        lambda f: _plan_problems(f)[0],
        PlanError,
    ),
]


def _sequence_check(tp: int, module_name: str) -> Any:
    # An uneven sequence shard would silently give wrong numbers inside DTensor.from_local: refuse it.
    def check(length: int) -> None:
        if length % tp:
            raise PlanError(
                f"sequence_parallel=True needs the sequence length divisible by tp: {module_name} sees length"
                f" {length}, tp={tp}; use a length that is a multiple of {tp}, or sequence_parallel=False"
            )

    return check


def _to_replicated(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _to_local(_module: nn.Module, outputs: Any, _mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def replicate_remaining(model: nn.Module, tp_mesh: DeviceMesh, skip: Collection[nn.Module] = ()) -> None:
    """Make the parameters the plan left whole into Replicate DTensors on the tp mesh.

    Every parameter is then a DTensor, so foreach optimizers and clipping never mix Tensor and DTensor;
    the module runs on replicated inputs and hands plain tensors on, as before. `skip`: modules another
    technique places (MoE experts: expert parallel makes them DTensors on the ep mesh).
    """
    for module in model.modules():
        if module in skip:
            continue
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            # torch types input_fn -> None; its pre-hook's result replaces the inputs
            distribute_module(module, tp_mesh, input_fn=_to_replicated, output_fn=_to_local)  # type: ignore[arg-type]


def apply_tensor_parallel(
    model: nn.Module,
    plan: ParallelPlan,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    skip: Collection[nn.Module] = (),
    vocab_sharded_output: bool = True,
    float8_styles: Optional[Callable[[nn.Module, str, Any], Optional[ParallelStyle]]] = None,
) -> None:
    """Shard `model` over `tp_mesh` as its plan says (modules inside blocks, then the rest).

    vocab_sharded_output=False: "vocab_head" gathers its logits like "head" (pipeline stages send plain tensors).
    float8_styles(module, style, output_layouts): the float8 style for a converted linear (lit_mesh/parallel/float8.py),
    or None for the plain one."""
    tp = tp_mesh.size()
    problem = tp_plan_problem(plan, tp, type(model).__name__)  # MeshStrategy refuses it earlier ("tp_fits_plan")
    if problem is not None:
        raise PlanError(problem)
    tied = tied_parameters(model)
    targets: list[tuple[nn.Module, str, str]] = [(model, name, style) for name, style in plan.tp.root.items()]
    blocks = list(cast(nn.ModuleList, model.get_submodule(plan.blocks)))  # the plan's blocks: a ModuleList
    for name in plan.tp.block:  # blocks may differ (dense and MoE): a name must exist in at least one
        if blocks and not any(_has_submodule(block, name) for block in blocks):
            raise PlanError(f"{type(model).__name__}.parallel_plan() names {name!r}, which no block has")
    for block in blocks:
        targets += [(block, name, style) for name, style in plan.tp.block.items() if _has_submodule(block, name)]
    for owner, name, style in targets:
        if not _held(owner, name, plan.blocks):
            continue  # a pipeline stage that does not hold this module
        try:
            module = owner.get_submodule(name)
        except AttributeError:
            raise PlanError(
                f"{type(model).__name__}.parallel_plan() names {name!r}, which the model does not have"
            ) from None
        if sequence_parallel and style == "embedding":
            check = _sequence_check(tp, name)
            module.register_forward_pre_hook(lambda _m, args, check=check: check(args[0].shape[1]))
        if sequence_parallel and style == "shard_output":
            check = _sequence_check(tp, name)
            module.register_forward_hook(lambda _m, _args, out, check=check: check(out.shape[1]))
        if style == "vocab_head" and not vocab_sharded_output:
            style = "head"
        float8_plan = (
            float8_styles(module, style, Shard(1) if sequence_parallel else Replicate()) if float8_styles else None
        )
        torch_plan: Optional[ParallelStyle]
        if float8_plan is not None:
            torch_plan = float8_plan
        elif style in plan.tp.custom_styles:
            torch_plan = plan.tp.custom_styles[style](sequence_parallel)
        else:
            torch_plan = torch_style(style, sequence_parallel, _sequence_check(tp, name))
        if torch_plan is not None:
            parallelize_module(owner, tp_mesh, {name: torch_plan})
    replicate_remaining(model, tp_mesh, skip)
    retie(tied, type(model).__name__)


def _held(owner: nn.Module, name: str, blocks: str) -> bool:
    """False where a pipeline stage does not hold the module `name`: dropped (None or a stand-in), or a block of
    another stage (a name into the plan's blocks that the pruned list lacks)."""
    module: nn.Module | None = owner
    path = name.split(".")
    for depth, part in enumerate(path):
        assert module is not None
        if part not in module._modules:
            return not (blocks and ".".join(path[:depth]) == blocks)  # else the model lacks it: an error below
        module = module._modules[part]
        if module is None or getattr(module, "pipeline_stand_in", False):
            return False
    return True


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        return module.get_submodule(name) is not None
    except AttributeError:
        return False
