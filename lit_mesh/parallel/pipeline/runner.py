"""This rank's pipeline stages and what runs them: `PipelineRunner`, the part every schedule shares (evaluation's
forward-only pass, outputs, the loss on every pp rank), and `ScheduleRunner`, training with one of torch's schedules
(torch.distributed.pipelining). PipeDream-2BW is the other runner (twobw.py); api.py picks one by schedule name.

How a training batch reaches the stages:
- MeshStrategy enters `pipeline_scope` (api.py) around each step; the LightningModule's `training_step` calls
  `loss_of(self.model, loss_fn, inputs, targets)`, which finds this runner there and calls `loss`.
- `loss` runs the whole schedule (forward and backward over the micro-batches) and returns the true loss on every
  pp rank, so `self.log("train_loss", loss)` and `ModelCheckpoint(monitor=...)` see the real value everywhere.
  Losses are scaled by 1 / (micro-batches x accumulation) inside the schedule, built with `scale_grads=False` (its
  own scaling would also divide gradients accumulated by earlier micro-steps).
- That loss carries the step's gradients: Lightning's own backward (hooks, precision plugin, `loss.backward()`)
  hands them to the parameters (`_HandOver`), after Lightning's zero_grad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage

from lit_mesh.errors import PipelineConfigError
from lit_mesh.parallel.pipeline.p2p import recv_with_header, send_with_header
from lit_mesh.parallel.pipeline.schedules import SCHEDULES, PipelineSettings
from lit_mesh.parallel.pipeline.split import Stage
from lit_mesh.parallel.pipeline.tied import TiedParameters
from lit_mesh.parallel.pipeline.torch_stage import ZeroFilledStage

# True while a runner drives its stages (a direct call of a stage is refused otherwise); set and reset around
# each pass, so nothing outlives it, and a stage keeps working under a later runner of another Trainer
_DRIVING: ContextVar[bool] = ContextVar("lit_mesh_pipeline_driving", default=False)

LossFn = Callable[[Tensor, Tensor], Tensor]


class _HandOver(torch.autograd.Function):
    """The training loss `loss_of` returns: its value is the step's mean loss, its backward (Lightning's, run after
    Lightning's zero_grad) gives the parameters the gradients the schedule made.

    Why the schedule runs in training_step and not in backward: `self.log` copies the loss when training_step logs
    it, and a pipeline knows its loss only after most of its backward (1F1B interleaves them); Lightning zeroes
    gradients between training_step and backward, so the schedule's gradients wait in this handle until then."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, value: Tensor, hand_over: Callable[[], None]) -> Tensor:
        ctx.hand_over = hand_over
        return value.clone()

    @staticmethod
    def backward(ctx: Any, _grad: Tensor) -> tuple[None, None, None]:
        # the schedule scaled its losses by fp16 loss scale / (micro-batches x accumulation) already (begin_step):
        # `_grad`, that loss scale / accumulation as Lightning's backward and its scaler make it, is not applied again
        hand_over, ctx.hand_over = ctx.hand_over, None
        if hand_over is not None:
            hand_over()
        return None, None, None


def carrying_gradients(value: Tensor, hand_over: Callable[[], None]) -> Tensor:
    """`value` (a loss) whose backward calls `hand_over` once."""
    anchor = torch.zeros((), device=value.device, requires_grad=True)
    return _HandOver.apply(anchor, value, hand_over)


class PipelineRunner:
    """This rank's stages: what every schedule shares. Subclasses train (`loss` with grad enabled)."""

    def __init__(
        self,
        stages: list[Stage],
        settings: PipelineSettings,
        pp_group: dist.ProcessGroup,
        stage_ranks: list[int],
        device: torch.device,
        parameters: Callable[[], list[nn.Parameter]],
    ) -> None:
        self.settings = settings
        self.group = pp_group
        self.pp = dist.get_world_size(pp_group)
        self.stage_ranks = stage_ranks  # pp rank of every stage
        self.last_stage_rank = stage_ranks[-1]
        self.holds_last_stage = dist.get_rank(pp_group) == self.last_stage_rank
        self.local_stages = stages
        self.model: Optional[nn.Module] = None  # the plan owner the stages were cut from (api.start_pipeline)
        self._parameters = parameters
        self.accumulation = 1
        self.fp16_loss_scale = 1.0
        self._handed_over = True  # this step's gradients reached the parameters (False from begin_step until then)
        self.n_microbatches = settings.n_microbatches(self.pp)
        self.stages: list[PipelineStage] = []  # torch's stages, where a torch schedule runs them
        self._build(stages, device)
        for stage in stages:
            stage.module.register_forward_pre_hook(self._refuse_direct_calls, prepend=True)
        self.recorder: Any = None  # lit_mesh.monitor.pipeline_timeline.TimelineRecorder while one is attached
        # context managers entered around each training step over the micro-batches, called with (inputs, loss
        # scale): what a technique measures over a step (MoE statistics: lit_mesh/parallel/pipeline/moe.py)
        self.step_contexts: list[Callable[[Tensor, float], Any]] = []
        self.tied: Optional[TiedParameters] = None  # parameters shared across stages (tied embeddings)

    def _build(self, stages: list[Stage], device: torch.device) -> None:
        """What a subclass makes of its stages before training (torch's schedule, 2bw's weight versions)."""

    # ---- what the strategy asks, hook by hook ---------------------------------------------------------------

    def begin_step(self, accumulation: int, loss_scale: float = 1.0) -> None:
        """Lightning's training_step: the losses of this step are scaled by 1 / (micro-batches x accumulation), and
        by the fp16 scaler's `loss_scale` (Lightning's backward then sees gradients scaled as its scaler made them)."""
        self.accumulation = accumulation
        self.fp16_loss_scale = loss_scale
        self._handed_over = False

    def check_handed_over(self) -> None:
        """After Lightning's backward: the loss it differentiated came from loss_of (else no gradient reached the
        stages' parameters)."""
        if not self._handed_over:
            raise RuntimeError(
                "backward ran without a pipelined forward: under pp > 1 the training_step must compute its loss"
                " with lit_mesh.loss_of(self.model, loss_fn, inputs, targets) and return it (or a sum with it)"
            )

    def before_save(self) -> None:
        """A checkpoint is about to be written (the synchronous schedules have nothing in flight between steps)."""

    def end_training(self) -> None:
        """fit() is ending (the synchronous schedules finish every batch within its step)."""

    def share_tied(self, tied: TiedParameters) -> None:
        """Keep `tied`'s copies one matrix: their gradients summed after each step's schedule, counted once."""
        self.tied = tied
        self.step_contexts.append(tied.summing_gradients)

    def norm_parameters(self, parameters: list[Tensor]) -> list[Tensor]:
        """The parameters whose gradients this rank adds to the global norm (a tied copy counts on one rank)."""
        return self.tied.counted_once(parameters) if self.tied is not None else parameters

    @property
    def clip_group(self) -> dist.ProcessGroup:
        """Gradient clipping: stages hold different parameters, so their norms add up over this group."""
        return self.group

    # ---- from the LightningModule's steps (api.py) ------------------------------------------------------------

    def loss(self, loss_fn: LossFn, inputs: Tensor, targets: Tensor) -> Tensor:
        """The mean loss of the batch, on every pp rank; in training it carries the step's gradients (a subclass's
        `train`), in evaluation a forward-only pass."""
        self._check_batch(inputs)
        if torch.is_grad_enabled():
            return self.train(loss_fn, inputs, targets)
        with self._driving():
            outputs = self._forward_only(inputs)
        if not self.holds_last_stage:
            local = torch.zeros((), device=inputs.device)
        else:
            micro_targets = targets.tensor_split(self.n_microbatches)
            local = torch.stack([loss_fn(out, target).float() for out, target in zip(outputs, micro_targets)]).mean()
        return self._broadcast(local)

    def train(self, loss_fn: LossFn, inputs: Tensor, targets: Tensor) -> Tensor:
        raise NotImplementedError

    def output(self, inputs: Tensor) -> Tensor:
        """The model's output for `inputs` (forward only), on every pp rank."""
        self._check_batch(inputs)
        outputs = self.forward_pass(inputs)
        out = torch.cat(outputs) if self.holds_last_stage else None
        meta: list[Any] = [(tuple(out.shape), out.dtype) if out is not None else None]  # broadcast from the last stage
        dist.broadcast_object_list(meta, group=self.group, group_src=self.last_stage_rank)
        shape, dtype = meta[0]
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=inputs.device)
        return self._broadcast(out.contiguous())

    def forward_pass(self, inputs: Tensor) -> list[Tensor]:
        """Every micro-batch of `inputs` forward through this rank's stages, without autograd; the last stage's
        outputs per micro-batch (empty on other ranks)."""
        with torch.no_grad(), self._driving():
            return self._forward_only(inputs)

    # ---- shared by the runners --------------------------------------------------------------------------------

    def _carrying(self, value: Tensor, hand_over: Callable[[], None]) -> Tensor:
        """`value` as the loss whose backward runs `hand_over` (the step's gradients to the parameters)."""

        def handing_over() -> None:
            hand_over()
            self._handed_over = True

        return carrying_gradients(value, handing_over)

    def _refuse_direct_calls(self, module: nn.Module, _args: Any) -> None:
        if not _DRIVING.get():
            raise RuntimeError(
                f"{type(module).__name__} is one pipeline stage under MeshStrategy(pp={self.pp}): call it through"
                " lit_mesh.loss_of(self.model, loss_fn, inputs, targets) (and output_of(self.model, inputs) for"
                " outputs) from the LightningModule's training_step, validation_step, test_step or predict_step while"
                " the Trainer runs them, not directly"
            )

    @contextmanager
    def _driving(self) -> Iterator[None]:
        token = _DRIVING.set(True)
        try:
            yield
        finally:
            _DRIVING.reset(token)

    @contextmanager
    def _around_step(self, inputs: Tensor, loss_scale: float) -> Iterator[None]:
        with ExitStack() as stack:
            for context in self.step_contexts:
                stack.enter_context(context(inputs, loss_scale))
            yield

    def _check_batch(self, inputs: Tensor) -> None:
        size = inputs.shape[0]
        if size % self.n_microbatches:
            raise PipelineConfigError(
                f"pp_microbatches={self.n_microbatches} does not divide the batch of {size} samples each pipeline"
                f" replica gets (global batch / data-parallel size); choose pp_microbatches among the divisors"
                f" of {size}, or change global_batch_size"
            )

    def _forward_only(self, inputs: Tensor) -> list[Tensor]:
        """Every micro-batch through this rank's stages in stage order (a DAG: no cycle, no deadlock); returns
        the last stage's outputs per micro-batch (empty on other ranks). Activations cross ranks by P2P.
        Evaluation has this loop of its own: torch re-runs its shape inference (a real forward and backward,
        dropping .grad) whenever a schedule switches between step() and eval(), and eval() of the multi-stage
        schedules still runs backward actions (torch 2.13)."""
        micro = list(inputs.tensor_split(self.n_microbatches))
        handed: dict[int, list[Tensor]] = {}  # stage index -> its inputs, when the previous stage is local
        outputs: list[Tensor] = []
        pending: list[Any] = []
        for stage in sorted(self.local_stages, key=lambda s: s.index):
            ins = micro if stage.index == 0 else handed.pop(stage.index, None)
            if ins is None:
                ins = [self._recv(self.stage_ranks[stage.index - 1], inputs.device) for _ in micro]
            outs = [stage.module(x) for x in ins]
            if stage.index == len(self.stage_ranks) - 1:
                outputs = outs
            elif self.stage_ranks[stage.index + 1] == self.stage_ranks[stage.index]:
                handed[stage.index + 1] = outs
            else:
                for out in outs:
                    pending += self._send(out, self.stage_ranks[stage.index + 1])
        for work in pending:
            work.wait()
        for stage in self.local_stages:  # FSDP units stay gathered after forward under pp (the schedule's
            for unit in stage.module.modules():  # backward reshards them); a forward alone must reshard itself
                if isinstance(unit, FSDPModule):
                    unit.reshard()
        return outputs

    def _send(self, tensor: Tensor, to: int) -> list[Any]:
        return send_with_header(tensor, to, self.group)

    def _recv(self, source: int, device: torch.device) -> Tensor:
        return recv_with_header(source, device, self.group)

    def _broadcast(self, tensor: Tensor) -> Tensor:
        dist.broadcast(tensor, group=self.group, group_src=self.last_stage_rank)
        return tensor


class ScheduleRunner(PipelineRunner):
    """Training with one of torch's schedules (every name in SCHEDULES but "2bw")."""

    def _build(self, stages: list[Stage], device: torch.device) -> None:
        self.stages = [self._torch_stage(s, device) for s in stages]
        schedule_cls, per_rank, _ = SCHEDULES[self.settings.schedule]
        assert schedule_cls is not None, f"pp_schedule={self.settings.schedule!r} has a runner of its own"
        owned = self.stages[0] if per_rank == "one" else self.stages
        self._loss_fn: Optional[LossFn] = None
        self._loss_scale = 1.0
        self._raw_losses: dict[int, Tensor] = {}  # id of the scaled loss the schedule keeps -> unscaled value
        self.schedule = schedule_cls(
            owned, n_microbatches=self.n_microbatches, loss_fn=self._microbatch_loss, scale_grads=False
        )

    def _torch_stage(self, stage: Stage, device: torch.device) -> PipelineStage:
        """torch's stage for one of ours: shapes inferred from the peers at the first step, each later stage computing
        on zeros there (torch_stage.py: every rank of a stage computes alike); the planner's fake step gives the
        shapes instead (fake ranks cannot answer)."""
        return ZeroFilledStage(stage.module, stage.index, len(self.stage_ranks), device, group=self.group)

    def _microbatch_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The loss the schedule calls on the last stage, once per micro-batch."""
        assert self._loss_fn is not None, "the schedule runs only from train()"
        loss = self._loss_fn(output, target)
        scaled = loss * self._loss_scale
        # keyed by the tensor the schedule reports: calls the schedule makes for shape inference do not count
        self._raw_losses[id(scaled)] = loss.detach().float()
        return scaled

    def train(self, loss_fn: LossFn, inputs: Tensor, targets: Tensor) -> Tensor:
        """The schedule's forward and backward over the micro-batches; the loss returned hands their gradients to
        the parameters when Lightning runs its backward."""
        losses: list[Tensor]
        self._loss_fn, self._raw_losses, losses = loss_fn, {}, []
        self._loss_scale = 1.0 / (self.n_microbatches * self.accumulation)
        if self.fp16_loss_scale != 1.0:
            self._loss_scale = self.fp16_loss_scale / (self.n_microbatches * self.accumulation)
        params = self._parameters()
        earlier = [p.grad for p in params]  # what earlier micro-steps accumulated: Lightning's zero_grad decides
        for p in params:
            p.grad = None
        try:
            recording = self.recorder.recording() if self.recorder is not None else nullcontext()
            with self._around_step(inputs, self._loss_scale), recording, self._driving():
                first = (inputs,) if any(stage.is_first for stage in self.stages) else ()
                self.schedule.step(*first, target=targets, losses=losses)
        finally:
            self._loss_fn = None
        fresh = [p.grad for p in params]
        for p, grad in zip(params, earlier):
            p.grad = grad
        if self.holds_last_stage:
            local = torch.stack([self._raw_losses[id(loss)] for loss in losses]).mean()
        else:
            local = torch.zeros((), device=inputs.device)
        self._raw_losses = {}
        return self._carrying(self._broadcast(local), lambda: self._add(params, fresh))

    @staticmethod
    def _add(params: list[nn.Parameter], fresh: list[Optional[Tensor]]) -> None:
        """This step's gradients onto what zero_grad left (earlier micro-steps of an accumulation window)."""
        for p, grad in zip(params, fresh):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad + grad
