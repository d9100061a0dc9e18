"""Pipeline parallelism inside Lightning's own loop, with torch.distributed.pipelining as the engine.

How it fits Lightning's automatic optimisation (see shared DESIGN, "Automatic optimisation"):
- `training_step` calls `loss_of(self.model, self.loss_fn, inputs, targets)`: on a pipelined model that runs the
  whole schedule (forward and backward over the micro-batches) and returns the true loss on every pp rank, so
  `self.log("train_loss", loss)` and `ModelCheckpoint(monitor=...)` see the real value everywhere.
- Lightning then calls `zero_grad` (first micro-step of an accumulation window) and `backward`: the gradients the
  schedule made are set aside before `zero_grad` can wipe them and added back in the strategy's `backward`.
- Losses are scaled by 1 / (micro-batches x accumulation) inside the schedule, built with `scale_grads=False`
  (its own scaling would also divide gradients accumulated by earlier micro-steps).
- pp_schedule="2bw" (PipeDream-2BW) is not one of torch's schedules: lit_mesh/parallel/pipeline_2bw.py runs it on
  these hooks, with batches in flight across steps and updates one step late.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import schedules as torch_schedules

from lit_mesh.parallel.pipeline_split import PipelineConfigError, Placement, Stage
from lit_mesh.unit import option

# name -> (torch schedule class, stages per rank: "one" or "many", placement of stages on ranks); None: lit-mesh's
# own driver (2bw: PipeDream-2BW, asynchronous, lit_mesh/parallel/pipeline_2bw.py)
SCHEDULES: dict[str, tuple[Optional[type], str, Placement]] = {
    "gpipe": (torch_schedules.ScheduleGPipe, "one", "loop"),
    "1f1b": (torch_schedules.Schedule1F1B, "one", "loop"),
    "interleaved_1f1b": (torch_schedules.ScheduleInterleaved1F1B, "many", "loop"),
    "looped_bfs": (torch_schedules.ScheduleLoopedBFS, "many", "loop"),
    "zero_bubble": (torch_schedules.ScheduleInterleavedZeroBubble, "many", "loop"),
    "zbv": (torch_schedules.ScheduleZBVZeroBubble, "two", "v"),
    "dualpipev": (torch_schedules.ScheduleDualPipeV, "two", "v"),
    "2bw": (None, "one", "loop"),
}

# the zero-bubble family: each backward runs in two parts, input gradients first (autograd with retain_graph) and
# weight gradients later; compiled or checkpointed blocks do not survive that (lit_mesh/rules.py)
SPLIT_BACKWARD = frozenset({"zero_bubble", "zbv", "dualpipev"})


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_MAX_DIMS = 8


@dataclass(frozen=True)
class PipelineSettings:
    """What the user chose: schedule, micro-batches per step, stages per rank, optional blocks per stage."""

    schedule: str = option(
        "1f1b",
        doc='"gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble" (interleaved zero bubble), "zbv" or'
        ' "dualpipev" (V-shaped, 2 stages per rank); or "2bw" (PipeDream-2BW: asynchronous 1F1B without a flush, each'
        " batch's gradient applied one step late, two weight versions per stage; pp alone, see"
        " lit_mesh/parallel/pipeline_2bw.py).",
        arg="pp_schedule",
    )
    microbatches: Optional[int] = option(  # None: pp (one per stage rank)
        None,
        doc="micro-batches per step (must divide each pipeline replica's batch); default pp (dualpipev: 2 x pp, one"
        " per stage).",
        arg="pp_microbatches",
    )
    stages_per_rank: Optional[int] = option(  # None: 1, or 2 for the schedules that need several
        None, doc="virtual stages per rank for the interleaved schedules (default 2 there, else 1).", arg="pp_stages_per_rank"
    )
    split: Optional[tuple[int, ...]] = option(
        None,
        doc="blocks per stage, e.g. [3, 5]; default: balanced, counting embedding and head as one block each.",
        arg="pp_split",
        accepts=Optional[list[int]],  # a tuple once checked (check_pipeline_settings)
    )

    @property
    def placement(self) -> Placement:
        return SCHEDULES[self.schedule][2]

    def local_stages(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if SCHEDULES[self.schedule][1] == "one" else 2

    def n_microbatches(self, pp: int) -> int:
        if self.microbatches is not None:
            return self.microbatches
        return max(pp, fewest_microbatches(self.schedule, pp, self.local_stages()))


def fewest_microbatches(schedule: str, pp: int, stages_per_rank: int) -> int:
    """The fewest micro-batches a schedule accepts: 1F1B one per stage, DualPipeV one per stage of its V; 2bw one per
    stage (each step's first backwards then finish the previous batch: at most two weight versions)."""
    return {"1f1b": pp, "2bw": pp, "dualpipev": pp * stages_per_rank}.get(schedule, 1)


_FEWER_MICROBATCHES = {"1f1b": "gpipe", "dualpipev": "zbv"}  # a schedule of the same shape that takes fewer


def microbatch_problem(settings: PipelineSettings, pp: int) -> Optional[str]:
    """Why torch's schedule refuses this many micro-batches at pp stage ranks (None: it accepts them), with counts
    that work; checked before any process starts (torch raises only inside the schedule's constructor)."""
    count, schedule = settings.n_microbatches(pp), settings.schedule
    fewest = fewest_microbatches(schedule, pp, settings.local_stages())
    if count < fewest:
        other = f", or use pp_schedule={_FEWER_MICROBATCHES[schedule]!r}" if schedule in _FEWER_MICROBATCHES else ""
        return f"needs at least {fewest} micro-batches (one per stage); set pp_microbatches >= {fewest}{other}"
    rounds = max(1, count // pp)  # the interleaved schedules run the micro-batches in rounds of pp
    if schedule in ("interleaved_1f1b", "zero_bubble") and count % rounds:
        return (
            f"runs micro-batches in {rounds} rounds of pp={pp} and {count} is not a multiple of {rounds}; set"
            f" pp_microbatches to a multiple of {pp}"
        )
    return None


def check_pipeline_settings(
    schedule: str, microbatches: Optional[int], stages_per_rank: Optional[int], split: Optional[Sequence[int]]
) -> PipelineSettings:
    """Each pipeline option on its own, in MeshStrategy.__init__ (with pp and each other: lit_mesh/rules.py)."""
    if schedule not in SCHEDULES:
        raise PipelineConfigError(f"pp_schedule={schedule!r} is not a schedule; choose one of {sorted(SCHEDULES)}")
    for name, value in (("pp_microbatches", microbatches), ("pp_stages_per_rank", stages_per_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PipelineConfigError(f"{name}={value!r} must be a positive int (or None for the default)")
    return PipelineSettings(schedule, microbatches, stages_per_rank, tuple(split) if split is not None else None)


class PipelineRunner:
    """This rank's stages and schedule, and the glue that runs them from Lightning's steps."""

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
        self._parameters = parameters
        self.accumulation = 1
        self._loss_fn: Optional[Callable[[Tensor, Tensor], Tensor]] = None
        self._loss_scale = 1.0
        self._raw_losses: dict[int, Tensor] = {}  # id of the scaled loss the schedule keeps -> unscaled value
        self._fresh_grads: Optional[list[Optional[Tensor]]] = None
        self.n_microbatches = settings.n_microbatches(self.pp)
        # training only: evaluation has its own forward-only loop (_forward_only), because torch re-runs its
        # shape inference (a real forward and backward, dropping .grad) whenever a schedule switches between
        # step() and eval(), and eval() of the multi-stage schedules still runs backward actions (torch 2.13)
        self.stages, self.schedule = self._build(stages, device)
        self._inside = False  # True while this runner drives the stages
        for stage in stages:
            stage.module.register_forward_pre_hook(self._refuse_direct_calls, prepend=True)
        self.recorder: Any = None  # lit_mesh.pipeline_timeline.TimelineRecorder while one is attached
        # context managers entered around each training schedule step, called with (inputs, loss scale): what a
        # technique measures over the micro-batches of a step (MoE statistics: lit_mesh/parallel/pipeline_moe.py)
        self.step_contexts: list[Callable[[Tensor, float], Any]] = []

    def _build(self, stages: list[Stage], device: torch.device) -> tuple[list[PipelineStage], Any]:
        n_stages = len(self.stage_ranks)
        built = [PipelineStage(s.module, s.index, n_stages, device, group=self.group) for s in stages]
        schedule_cls, per_rank, _ = SCHEDULES[self.settings.schedule]
        owned = built[0] if per_rank == "one" else built
        schedule = schedule_cls(owned, n_microbatches=self.n_microbatches, loss_fn=self._microbatch_loss, scale_grads=False)
        return built, schedule

    # ---- the loss the schedule calls on the last stage, once per micro-batch ----------------------------

    def _microbatch_loss(self, output: Tensor, target: Tensor) -> Tensor:
        assert self._loss_fn is not None, "the schedule runs only from loss()"
        loss = self._loss_fn(output, target)
        scaled = loss * self._loss_scale
        # keyed by the tensor the schedule reports: calls the schedule makes for shape inference do not count
        self._raw_losses[id(scaled)] = loss.detach().float()
        return scaled

    def _refuse_direct_calls(self, module: nn.Module, _args: Any) -> None:
        if not self._inside:
            raise RuntimeError(
                f"{type(module).__name__} is one pipeline stage under MeshStrategy(pp={self.pp}): call it through"
                " lit_mesh.loss_of(self.model, loss_fn, inputs, targets) in training_step (and output_of(self.model,"
                " inputs) to get outputs), not directly"
            )

    @contextmanager
    def _driving(self) -> Iterator[None]:
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    def _check_batch(self, inputs: Tensor) -> None:
        size = inputs.shape[0]
        if size % self.n_microbatches:
            raise PipelineConfigError(
                f"pp_microbatches={self.n_microbatches} does not divide the batch of {size} samples each pipeline"
                f" replica gets (global batch / data-parallel size); choose pp_microbatches among the divisors"
                f" of {size}, or change global_batch_size"
            )

    # ---- from the LightningModule's steps ----------------------------------------------------------------

    def loss(self, loss_fn: Callable[[Tensor, Tensor], Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
        """The mean loss of the batch, on every pp rank; in training, gradients are made here as well."""
        self._check_batch(inputs)
        self._loss_fn, self._raw_losses, losses = loss_fn, {}, []
        try:
            if torch.is_grad_enabled():
                self._loss_scale = 1.0 / (self.n_microbatches * self.accumulation)
                self._run_and_set_aside_grads(inputs, targets, losses)
            else:
                with self._driving():
                    outputs = self._forward_only(inputs)
                losses = [loss_fn(out, target) for out, target in zip(outputs, targets.tensor_split(self.n_microbatches))]
        finally:
            self._loss_fn = None
        if not self.holds_last_stage:
            local = torch.zeros((), device=inputs.device)
        elif torch.is_grad_enabled():
            local = torch.stack([self._raw_losses[id(loss)] for loss in losses]).mean()
        else:
            local = torch.stack([loss.float() for loss in losses]).mean()
        self._raw_losses = {}
        return self._broadcast(local)

    def output(self, inputs: Tensor) -> Tensor:
        """The model's output for `inputs` (forward only), on every pp rank."""
        self._check_batch(inputs)
        outputs = self.forward_pass(inputs)
        out = torch.cat(outputs) if self.holds_last_stage else None
        meta = [(tuple(out.shape), out.dtype) if out is not None else None]
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

    def _forward_only(self, inputs: Tensor) -> list[Tensor]:
        """Every micro-batch through this rank's stages in stage order (a DAG: no cycle, no deadlock); returns
        the last stage's outputs per micro-batch (empty on other ranks). Activations cross ranks by P2P."""
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
        tensor = tensor.contiguous()
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=tensor.device)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        return [dist.isend(header, group=self.group, group_dst=to), dist.isend(tensor, group=self.group, group_dst=to)]

    def _recv(self, source: int, device: torch.device) -> Tensor:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        dist.recv(header, group=self.group, group_src=source)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
        dist.recv(tensor, group=self.group, group_src=source)
        return tensor

    def _first_stage_args(self, inputs: Tensor) -> tuple:
        return (inputs,) if any(stage.is_first for stage in self.stages) else ()


    def _broadcast(self, tensor: Tensor) -> Tensor:
        dist.broadcast(tensor, group=self.group, group_src=self.last_stage_rank)
        return tensor

    # ---- gradients: made in training_step, handed to Lightning's backward -------------------------------

    def _run_and_set_aside_grads(self, inputs: Tensor, targets: Tensor, losses: list) -> None:
        params = self._parameters()
        earlier = [p.grad for p in params]  # what earlier micro-steps accumulated; zero_grad may still clear it
        for p in params:
            p.grad = None
        with self._around_step(inputs), self.recorder.recording() if self.recorder is not None else nullcontext():
            with self._driving():
                self.schedule.step(*self._first_stage_args(inputs), target=targets, losses=losses)
        self._fresh_grads = [p.grad for p in params]
        for p, grad in zip(params, earlier):
            p.grad = grad

    @contextmanager
    def _around_step(self, inputs: Tensor) -> Iterator[None]:
        with ExitStack() as stack:
            for context in self.step_contexts:
                stack.enter_context(context(inputs, self._loss_scale))
            yield

    def add_fresh_grads(self) -> None:
        """Called from the strategy's backward: add this step's gradients to what zero_grad left."""
        if self._fresh_grads is None:
            raise RuntimeError(
                "backward ran without a pipelined forward: under pp > 1 the training_step must compute its loss"
                " with lit_mesh.loss_of(self.model, loss_fn, inputs, targets)"
            )
        for p, fresh in zip(self._parameters(), self._fresh_grads):
            if fresh is not None:
                p.grad = fresh if p.grad is None else p.grad + fresh
        self._fresh_grads = None


    # ---- what the strategy asks, hook by hook -------------------------------------------------------------

    def begin_step(self, accumulation: int) -> None:
        """Lightning's training_step: the losses of this step are scaled by 1 / (micro-batches x accumulation)."""
        self.accumulation = accumulation

    def before_save(self) -> None:
        """A checkpoint is about to be written (the synchronous schedules have nothing in flight between steps)."""

    def end_training(self) -> None:
        """fit() is ending (the synchronous schedules finish every batch within its step)."""

    def backward(self, loss: Tensor, strategy: Any, module: Any) -> Tensor:
        """Lightning's backward: the schedule ran forward and backward inside training_step (loss_of); the
        strategy's and the precision plugin's hooks still run around it, and this step's gradients are added."""
        strategy.pre_backward(loss)
        loss = strategy.precision_plugin.pre_backward(loss, module)
        self.add_fresh_grads()
        loss = strategy.precision_plugin.post_backward(loss, module)
        strategy.post_backward(loss)
        return loss

    @property
    def clip_group(self) -> dist.ProcessGroup:
        """Gradient clipping: stages hold different parameters, so their norms add up over this group."""
        return self.group


_RUNNER_ATTR = "_lit_mesh_pipeline"


def start_pipeline(
    owner: nn.Module, stages: list[Stage], stage_ranks: list[int], settings: PipelineSettings, pp_group: dist.ProcessGroup,
    device: torch.device,
) -> PipelineRunner:
    """Build this rank's schedule over its stages of `owner` (the plan owner cut into stages) and attach it, so
    that loss_of/output_of on `owner` run the pipeline."""
    runner_cls = PipelineRunner
    if settings.schedule == "2bw":
        from lit_mesh.parallel.pipeline_2bw import TwoBWRunner  # it builds on PipelineRunner

        runner_cls = TwoBWRunner
    runner = runner_cls(stages, settings, pp_group, stage_ranks, device=device, parameters=lambda: list(owner.parameters()))
    attach_runner(owner, runner)
    return runner


def attach_runner(model: nn.Module, runner: PipelineRunner) -> None:
    setattr(model, _RUNNER_ATTR, runner)  # a plain attribute: not a submodule, not in the state dict


def runner_of(model: nn.Module) -> Optional[PipelineRunner]:
    return getattr(model, _RUNNER_ATTR, None)


def loss_of(model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor], inputs: Tensor, targets: Tensor) -> Tensor:
    """`loss_fn(model(inputs), targets)`; when MeshStrategy pipelines `model` (pp > 1), the same loss computed by
    the pipeline schedule over micro-batches (in training its backward runs here too), on every pp rank.

    The one line a LightningModule changes for pipeline parallelism. `loss_fn` must be a mean over the batch.
    """
    runner = runner_of(model)
    if runner is None:
        return loss_fn(model(inputs), targets)
    return runner.loss(loss_fn, inputs, targets)


def is_pipelined(model: nn.Module) -> bool:
    """True when MeshStrategy cut `model` into pipeline stages (pp > 1): each rank holds only its stages' part."""
    return runner_of(model) is not None


def sum_over_stages(model: nn.Module, tensor: Tensor) -> Tensor:
    """`tensor` summed over the pipeline stages of `model` in place, where each stage holds its own layers' part
    (zeros elsewhere); `tensor` itself when `model` is not pipelined. A collective over pp: call it on every rank."""
    runner = runner_of(model)
    if runner is not None:
        dist.all_reduce(tensor, group=runner.group)
    return tensor


def output_of(model: nn.Module, inputs: Tensor) -> Tensor:
    """`model(inputs)`; when MeshStrategy pipelines `model`, a forward-only pass through every stage whose
    output (the last stage's) is returned on every pp rank. For evaluation and prediction."""
    runner = runner_of(model)
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
