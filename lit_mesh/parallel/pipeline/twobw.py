"""PipeDream-2BW (`pp_schedule="2bw"`): asynchronous 1F1B with double-buffered weights and a one-step-delayed update.

The rule every stage follows (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021):
    W_{t+1} = W_t - update(grad f(W_{t-1}; batch t-1))
At step 0 no gradient is ready: the optimizer sees grad None for every parameter and skips (exact for torch's
optimizers: no state is created, no step counted). The last batch's gradient is computed at the end of training
(the pipeline drains) but never applied.

How it runs inside one Lightning step t, on stage s of P (one stage per rank, warm-up w = P-1-s):
- 1F1B over the global micro-batch index, continuous across steps: m forwards of batch t, each followed by one
  backward once w forwards are in flight. The first w backwards of step t finish batch t-1 (its forwards ran at
  step t-1), the rest belong to batch t; the last stage (w = 0) finishes its batch within the step. No flush: the
  bubble is the warm-up of step 0 and the drain at the end of training only.
- Weight versions: batch t's forwards run with `torch.func.functional_call` on leaves viewing the storage the live
  parameters hold (W_t); their backward, possibly at step t+1, differentiates with respect to those leaves, so it
  uses W_t whatever the parameters hold by then. In Lightning's backward of the step's loss (before the optimizer
  step) the finished gradient of batch t-1 goes into `.grad`, W_t is copied into the storage batch t-1 used (its
  backwards are done) and the parameters point at it: the in-place optimizer update writes W_{t+1} there and W_t
  stays intact for batch t's pending backwards. Two storages per weight at most (`weight_storage_bytes`).
- Gradients accumulate on each version's leaves: at most two sets (batch t-1 finishing, batch t starting).
- P2P (lit_mesh/parallel/pipeline/p2p.py, StepExchange): as torch's schedules, a send goes in one batch_isend_irecv
  with the next receive from the same peer (a forward's send with the next backward's receive, a backward's send
  with the next forward's receive); what is left at the end of a step is sent then and waited one step later (a
  gradient for the previous stage is received there only at its next step). An activation's shape follows from its
  micro-batch's: a header goes with the first of each micro-batch shape only (no host read per message); gradients
  take the shape of their output.

Checkpoints hold the weights and optimizer state after the last applied update (W_{t+1}); the in-flight gradient
of batch t is not saved, and a resumed run restarts the delay line: its first step applies no update, as step 0.
Refused (lit_mesh/parallel/pipeline/rules.py): data, tensor, context and expert parallelism, MoE, several stages per
rank, activation checkpointing and compiled blocks; gradient accumulation raises at the first step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional, cast

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.func import functional_call

from lit_mesh.errors import PipelineConfigError
from lit_mesh.parallel.pipeline.p2p import StepExchange
from lit_mesh.parallel.pipeline.runner import LossFn, PipelineRunner
from lit_mesh.parallel.pipeline.split import Stage


@dataclass
class _Version:
    """One weight version: the storage the live parameters held when its batch started, and the autograd leaves
    (views of it) its forwards ran with. The leaves' .grad accumulate that batch's gradient."""

    storage: list[Tensor]
    leaves: dict[str, Tensor]


@dataclass
class _InFlight:
    """A forward whose backward is pending: its output (the scaled loss on the last stage) and its input leaf."""

    output: Tensor
    input: Optional[Tensor]
    microbatch: int


class TwoBWRunner(PipelineRunner):
    """One stage per rank, driven by our own continuous 1F1B loop (no torch schedule: it flushes every step).
    Evaluation uses the shared forward-only loop on the module itself (the live, newest weights)."""

    def _build(self, stages: list[Stage], device: torch.device) -> None:
        if len(stages) != 1:  # rules.py beside this refuses it before launch; this guards direct use
            raise PipelineConfigError(f"pp_schedule='2bw' runs one stage per rank, not {len(stages)}")
        stage = stages[0]
        self._module: nn.Module = stage.module
        self._names = [name for name, _ in stage.module.named_parameters()]
        self._index, n_stages = stage.index, len(self.stage_ranks)
        self._first, self._last = stage.index == 0, stage.index == n_stages - 1
        self._warmup = n_stages - 1 - stage.index
        self._previous = None if self._first else self.stage_ranks[stage.index - 1]
        self._next = None if self._last else self.stage_ranks[stage.index + 1]
        self._held: list[_Version] = []  # oldest first, at most two
        self._in_flight: deque[_InFlight] = deque()
        self._exchange = StepExchange(self.group)
        self._warned_save = False

    # ---- what the strategy asks ----------------------------------------------------------------------------

    def begin_step(self, accumulation: int, loss_scale: float = 1.0) -> None:
        if accumulation != 1:
            raise PipelineConfigError(
                f"pp_schedule='2bw' with accumulate_grad_batches={accumulation}: it applies every batch's gradient"
                " one step later, from the pipeline's continuous 1F1B, which has no accumulation window; set"
                " accumulate_grad_batches=1 (raise the batch size or pp_microbatches instead) or use pp_schedule='1f1b'"
            )
        super().begin_step(1, loss_scale)  # an fp16 loss scale: refused before launch (rules.py)

    def train(self, loss_fn: LossFn, inputs: Tensor, targets: Tensor) -> Tensor:
        """This step's forwards, and the backwards 1F1B reaches; the loss returned hands the previous batch's
        finished gradient to the parameters when Lightning runs its backward."""
        m, device = self.n_microbatches, inputs.device
        version = self._open_version()
        raw: list[Tensor] = []
        recording = self.recorder.recording() if self.recorder is not None else nullcontext()
        with self._driving(), recording:
            for k, (micro, target) in enumerate(zip(inputs.tensor_split(m), targets.tensor_split(m))):
                self._in_flight.append(self._forward(version, micro, target, loss_fn, raw, k))
                if len(self._in_flight) > self._warmup:
                    self._backward(self._in_flight.popleft())
        self._exchange.end_step()
        local = torch.stack(raw).mean() if self._last else torch.zeros((), device=device)
        return self._carrying(self._broadcast(local), self._hand_over)

    def before_save(self) -> None:
        if self._held and not self._warned_save:  # a version whose gradient is still to be applied
            self._warned_save = True
            rank_zero_warn(
                "pp_schedule='2bw': the checkpoint holds the weights and optimizer state after the last applied update;"
                " the last batch's gradient (applied one step later) is in flight and not saved, so a run resumed from"
                " it restarts the one-step delay (its first step applies no update)"
            )

    def end_training(self) -> None:
        """Drain the pipeline: the pending backwards of the last batch (1F1B's cool-down), so that every send is
        received; that gradient is never applied. Then only the live weights remain."""
        with self._driving():
            while self._in_flight:
                self._backward(self._in_flight.popleft())
        self._exchange.end_step()  # sends the drain's last gradients
        self._exchange.end_step()  # and waits them
        self._held = []

    # ---- weights ---------------------------------------------------------------------------------------------

    def _parameters_in_order(self) -> list[nn.Parameter]:
        return [p for _, p in self._module.named_parameters()]

    def _open_version(self) -> _Version:
        # p.data: a tensor of its own (its own version counter) on the live storage; the leaves share its counter,
        # so a write into this storage while a graph still needs it fails loudly in backward
        storage = [p.data for p in self._parameters_in_order()]
        leaves = {name: t.detach().requires_grad_(True) for name, t in zip(self._names, storage)}
        self._held.append(_Version(storage, leaves))
        assert len(self._held) <= 2, "2bw holds at most two weight versions"
        return self._held[-1]

    def _hand_over(self) -> None:
        """From Lightning's backward (after zero_grad, before clipping and the optimizer step): the finished gradient
        of the previous batch into .grad, and the live parameters moved to the spare storage for the update."""
        current = self._held[-1]
        finished = self._held[0] if len(self._held) == 2 else None
        params = self._parameters_in_order()
        for name, p in zip(self._names, params):
            p.grad = finished.leaves[name].grad if finished is not None else None
        with torch.no_grad():
            if finished is None:  # the second buffer, once (step 0 and the first step after a resume)
                spare = [t.clone() for t in current.storage]
            else:  # batch t-1's storage: its backwards are done; W_t goes there, the update then makes W_{t+1}
                spare = finished.storage
                for dst, src in zip(spare, current.storage):
                    dst.copy_(src)
            for p, dst in zip(params, spare):
                p.data = dst
        self._held = [current]

    def weight_storage_bytes(self) -> tuple[int, int]:
        """(bytes of the distinct storages holding this stage's weights: live parameters and held versions, bytes
        of one copy of the weights)."""
        tensors = [p for p in self._parameters_in_order()] + [t for v in self._held for t in v.storage]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values()), sum(p.numel() * p.element_size() for p in self._parameters_in_order())

    # ---- one forward, one backward ----------------------------------------------------------------------------

    def _forward(
        self, version: _Version, micro: Tensor, target: Tensor, loss_fn: Callable, raw: list, k: int
    ) -> _InFlight:
        # the timed blocks hold the computation only, as torch's stages do (waiting for a receive is bubble)
        x = micro
        if not self._first:
            x = self._exchange.recv_activation(cast(int, self._previous), micro).requires_grad_(True)
        with self._block("F", k):
            out = functional_call(self._module, version.leaves, (x,))
            if self._last:
                loss = loss_fn(out, target)
                raw.append(loss.detach().float())
                return _InFlight(loss * (1.0 / self.n_microbatches), None if self._first else x, k)
        self._exchange.send_activation(out.detach(), cast(int, self._next), micro)  # not the last stage
        return _InFlight(out, None if self._first else x, k)

    def _backward(self, item: _InFlight) -> None:
        if self._last:
            with self._block("B", item.microbatch):
                item.output.backward()
        else:
            grad = self._exchange.recv_gradient(item.output, cast(int, self._next))
            with self._block("B", item.microbatch):
                torch.autograd.backward(item.output, grad)
        if item.input is not None:
            grad_in = cast(Tensor, item.input.grad)  # the backward above gave it
            self._exchange.send_gradient(grad_in, cast(int, self._previous))

    @contextmanager
    def _block(self, kind: str, microbatch: int) -> Iterator[None]:
        if self.recorder is None:
            yield
            return
        with self.recorder.timed_block(kind, self._index, microbatch):
            yield
