"""What a LightningModule calls for pipeline parallelism, and how MeshStrategy connects it to its run.

What a LightningModule calls (`loss_of`, `output_of`, `is_pipelined`, `sum_over_stages`), and how MeshStrategy
connects them to its run: `start_pipeline` makes the runner for the chosen schedule, and `pipeline_scope`, entered
by the strategy around each training, validation, test and predict step, maps the pipelined model to it.

The model carries nothing: outside a step a pipelined model is found by no one, and a call of its stages is
refused with the fix (runner.py). Scopes are context variables set and reset around each step, so several
Trainers and models in one process (validate or test after fit, the fork launcher's runs) never see each other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lit_mesh.parallel.pipeline.runner import LossFn, PipelineRunner, ScheduleRunner
from lit_mesh.parallel.pipeline.schedules import PipelineSettings
from lit_mesh.parallel.pipeline.split import Stage
from lit_mesh.parallel.pipeline.twobw import TwoBWRunner

# (model, its runner) for the steps running now: empty outside them
_SCOPE: ContextVar[tuple[tuple[nn.Module, PipelineRunner], ...]] = ContextVar("lit_mesh_pipeline_scope", default=())


def start_pipeline(
    owner: nn.Module,
    stages: list[Stage],
    stage_ranks: list[int],
    settings: PipelineSettings,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    refuse_calls: bool = True,
) -> PipelineRunner:
    """This rank's runner over its stages of `owner`.

    This rank's runner over its stages of `owner` (the plan owner cut into stages): 2bw's own driver, or torch's
    schedule for every other name. `refuse_calls=False`: the plan takes over calls of the whole model
    (PipelinePlan.calls), so they are not refused.
    """
    runner_cls = TwoBWRunner if settings.schedule == "2bw" else ScheduleRunner
    runner = runner_cls(
        stages, settings, pp_group, stage_ranks, device=device, parameters=lambda: list(owner.parameters())
    )
    runner.model = owner
    if refuse_calls and all(stage.module is not owner for stage in stages):  # views (several stages per rank)
        owner.register_forward_pre_hook(runner._refuse_direct_calls, prepend=True)
    return runner


@contextmanager
def pipeline_scope(runner: Optional[PipelineRunner]) -> Iterator[None]:
    """While a step runs: loss_of / output_of on the runner's model run its pipeline (nothing without a runner)."""
    if runner is None:
        yield
        return
    assert runner.model is not None, "start_pipeline sets the runner's model"
    token = _SCOPE.set((*_SCOPE.get(), (runner.model, runner)))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def _runner_of(model: nn.Module) -> Optional[PipelineRunner]:
    for pipelined, runner in _SCOPE.get():
        if pipelined is model:
            return runner
    return None


def loss_of(model: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor) -> Tensor:
    """The loss of `model` on a batch, pipelined over micro-batches when MeshStrategy cut `model` into stages.

    `loss_fn(model(inputs), targets)`; when MeshStrategy pipelines `model` (pp > 1), the same loss computed by
    the pipeline schedule over micro-batches, on every pp rank (in training the schedule's backward runs here too,
    and Lightning's backward of the returned loss hands its gradients to the parameters).

    The one line a LightningModule changes for pipeline parallelism. `loss_fn` must be a mean over the batch.
    """
    runner = _runner_of(model)
    if runner is None:
        return loss_fn(model(inputs), targets)
    return runner.loss(loss_fn, inputs, targets)


def is_pipelined(model: nn.Module) -> bool:
    """Whether MeshStrategy cut `model` into pipeline stages for the current step.

    True inside a step when MeshStrategy cut `model` into pipeline stages (pp > 1): each rank holds only its
    stages' part.
    """
    return _runner_of(model) is not None


def microbatches(model: nn.Module) -> int:
    """How many micro-batches the pipeline of `model` cuts a batch into in the current step (1 when not pipelined)."""
    runner = _runner_of(model)
    return runner.n_microbatches if runner is not None else 1


def sum_over_stages(model: nn.Module, tensor: Tensor) -> Tensor:
    """Sum `tensor` over the pipeline stages of `model`.

    `tensor` summed over the pipeline stages of `model` in place, where each stage holds its own layers' part
    (zeros elsewhere); `tensor` itself when `model` is not pipelined. A collective over pp: call it on every rank.
    """
    runner = _runner_of(model)
    if runner is not None:
        dist.all_reduce(tensor, group=runner.group)
    return tensor


def output_of(model: nn.Module, inputs: Tensor) -> Tensor:
    """The output of `model` on `inputs`, through every pipeline stage when `model` is pipelined.

    `model(inputs)`; when MeshStrategy pipelines `model`, a forward-only pass through every stage whose
    output (the last stage's) is returned on every pp rank. For evaluation and prediction.
    """
    runner = _runner_of(model)
    if runner is None:
        out = model(inputs)
        # whole logits for the caller where the head keeps them vocabulary-sharded for the loss ("vocab_head")
        return out.full_tensor() if isinstance(out, DTensor) else out
    if torch.is_grad_enabled() and model.training:
        raise RuntimeError(
            "output_of() runs the pipeline forward only; in training_step use lit_mesh.loss_of(self.model, loss_fn,"
            " inputs, targets) so that the schedule also runs the backward"
        )
    return runner.output(inputs)
