"""pp x MoE: the MoE layers' balancing statistics when pipeline stages run the layers micro-batch by micro-batch.

Without pp the LightningModule adds the MoE layers' auxiliary loss to its loss after one forward of the whole
local batch, with each layer's load summed over the dp x cp ranks (zoo/moe.py). Under pp the schedule runs the
forward and the backward of every micro-batch on each stage inside `loss_of`, so here:
- each stage adds its MoE layers' aux loss to its own backward, per micro-batch (as Megatron's
  MoEAuxLossAutoScaler): an identity on the layer's output whose backward also gives the micro-batch's mean
  router probabilities P_m the gradient d aux(load, P) / dP x the loss scale 1 / (micro-batches x accumulation).
  The aux loss is linear in P (Switch: coef x E x sum_i f_i P_i) and P is the mean of the equal micro-batches'
  P_m, so these gradients add up to the one-device gradient exactly;
- its load f is the whole step's: every micro-batch on every dp x cp rank. Most schedules run a micro-batch's
  backward before the forward of later ones, so a forward-only routing pass over the step's micro-batches (no
  autograd: one forward more per step) measures it first. Why not per micro-batch, as Megatron: that is a
  different loss from the one-device one, and layouts would no longer agree;
- after the step each layer holds the step's global load and aux loss value (`use_load`), as without pp: the
  LightningModule logs them (summed over the stages: lit_mesh.sum_over_stages), and the aux-loss-free bias of a
  stage's layers updates from them.

What a MoE layer provides (zoo/moe.py's MoE): after a forward `local_load` (tokens per expert on this rank) and
`mean_probs` (differentiable), `dropped` optionally; `aux_loss_of(load, mean_probs)` and `use_load(load)`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_mesh.parallel.expert import MoELayer, moe_layers
from lit_mesh.parallel.pipeline.runner import PipelineRunner
from lit_mesh.plan import PlanError, PlanOwner

_PROVIDES = ("local_load", "mean_probs", "aux_loss_of", "use_load")


class _PipelinedMoE(MoELayer):
    """An MoE layer that provides `_PROVIDES` (checked by carry_moe_statistics): a type only."""

    local_load: Tensor
    mean_probs: Tensor
    dropped: Tensor
    aux_loss_of: Callable[[Tensor, Tensor], Tensor]
    use_load: Callable[[Tensor], None]


class _LayerStep:
    """One MoE layer's routing over the micro-batches of a step on this rank."""

    def __init__(self, layer: _PipelinedMoE) -> None:
        self.layer = layer
        self.loads: list[Tensor] = []
        self.probs: list[Tensor] = []
        self.dropped: list[Tensor] = []
        self.load: Tensor | None = None  # the step's global load: every micro-batch, every dp x cp rank
        self.gradient: Tensor | None = None  # of the aux loss by one micro-batch's mean probabilities

    def record(self) -> None:
        self.loads.append(self.layer.local_load)
        self.probs.append(self.layer.mean_probs.detach())
        dropped = getattr(self.layer, "dropped", None)  # assignments over capacity; still meta where none is set
        if isinstance(dropped, Tensor) and not dropped.is_meta:
            self.dropped.append(dropped.detach())
        else:
            self.dropped.append(torch.zeros((), device=self.layer.local_load.device))

    def mean_probs(self) -> Tensor:
        return torch.stack(self.probs).mean(dim=0)  # equal micro-batches: the mean over the rank's batch


class _AddAuxGradient(torch.autograd.Function):
    """Identity on a MoE layer's output; its backward also sends the layer's aux loss gradient into the
    micro-batch's mean router probabilities."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, mean_probs: Tensor, step: _LayerStep, scale: float) -> Tensor:
        ctx.step, ctx.scale = step, scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        step = ctx.step
        assert step.gradient is not None, "the routing pass sets the step's load before the schedule runs"
        return grad, step.gradient * ctx.scale, None, None


class MoEStageStatistics:
    """This rank's MoE layers under pp: a step context of the PipelineRunner (routing pass, then the schedule
    with the aux loss gradient in each stage's backward, then each layer's step statistics)."""

    def __init__(self, runner: PipelineRunner, layers: list[_PipelinedMoE], load_group: dist.ProcessGroup) -> None:
        self.runner = runner
        self.load_group = load_group
        self.steps = [_LayerStep(layer) for layer in layers]
        self._recording = False
        self._scale = 1.0
        for step in self.steps:
            step.layer.register_forward_hook(self._after_forward(step))

    def _after_forward(self, step: _LayerStep) -> Any:
        def hook(_layer: nn.Module, _args: Any, output: Tensor) -> Tensor | None:
            if self._recording:
                step.record()
                return None
            if not (torch.is_grad_enabled() and step.layer.mean_probs.requires_grad):
                return None  # evaluation
            return _AddAuxGradient.apply(output, step.layer.mean_probs, step, self._scale)

        return hook

    @contextmanager
    def step(self, inputs: Tensor, loss_scale: float) -> Iterator[None]:
        """Around one schedule step: the routing pass first, each layer's step statistics after."""
        self._scale = loss_scale
        for step in self.steps:
            step.loads, step.probs, step.dropped = [], [], []
        self._recording = True
        try:
            self.runner.forward_pass(inputs)
        finally:
            self._recording = False
        self._global_loads()
        yield
        for step in self.steps:
            step.layer.mean_probs = step.mean_probs()
            # the step's load (set by _global_loads) and aux loss value, for logging and the bias update
            step.layer.use_load(cast(Tensor, step.load))
            step.layer.dropped = torch.stack(step.dropped).sum()

    def _global_loads(self) -> None:
        if not self.steps:
            return  # a stage of dense blocks only (its dp x cp group holds the same stage: nobody waits)
        loads = torch.stack([torch.stack(step.loads).sum(dim=0) for step in self.steps])
        dist.all_reduce(loads, group=self.load_group)  # one collective for all this rank's layers
        for step, load in zip(self.steps, loads):
            step.load = load
            with torch.enable_grad():  # the aux loss is linear in the probabilities: one gradient for the step
                probs = step.mean_probs().requires_grad_()
                (step.gradient,) = torch.autograd.grad(step.layer.aux_loss_of(load, probs), probs)


def carry_moe_statistics(runner: PipelineRunner, owner: PlanOwner, load_group: dist.ProcessGroup) -> None:
    """Attach the MoE statistics of `owner`'s layers on this rank's stages to the runner (nothing for a dense model,
    nor for one whose plan adds no balancing loss under pp)."""
    if owner.plan.moe is None or not owner.plan.moe.balancing_under_pp:
        return
    layers = list(moe_layers(owner.module, owner.plan))
    missing = sorted({name for layer in layers for name in _PROVIDES if not hasattr(layer, name)})
    if missing:
        raise PlanError(
            f"pp={runner.pp} with the MoE layers of {type(owner.module).__name__}: they lack {missing}, which pipeline"
            " stages need to add the balancing loss of the whole step (see zoo/moe.py's MoE); use pp=1 (ep, dp, tp"
            " and cp work with them)"
        )
    runner.step_contexts.append(MoEStageStatistics(runner, cast(list[_PipelinedMoE], layers), load_group).step)
