"""StepAudit: count what one training step that logs nothing costs beyond its compute.

Between on_train_batch_start and on_train_batch_end of the audited step, on every rank:
- host syncs (lit_mesh/monitor/host_syncs.py): host reads (Tensor.item / tolist / __bool__ / cpu; the optimizer's
  own `step` counters excluded: torch keeps them on the host), ops that read device values (nonzero, boolean-mask
  indexing, masked_select, unique, repeat_interleave without output_size, equal) and host data sent to the device,
  with the call sites;
- collectives: every c10d op (FSDP2, DDP, send/recv, barrier) and functional collective (DTensor: TP, SP), with
  its process group's size;
- declared host reads, counted apart: the one read per MoE layer of its all-to-all split sizes under expert
  parallel (`DECLARED_HOST_READS`; data-dependent split sizes must reach the host), so that a test can bound them
  by the MoE layers.
On CPU these calls cost nothing; on a GPU each host read waits for the queued kernels (a stream sync) and each
collective is a kernel launch and a wait. Counting the calls is the CPU stand-in for that cost.
Our own: torch's CommDebugMode counts functional collectives and c10d ops, but not host reads.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor._dispatch import OpDispatcher
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from lit_mesh.monitor.comm import _group_name, _group_size
from lit_mesh.monitor.host_syncs import HostSyncCounter
from lit_mesh.parallel.expert import MOE_SPLIT_SIZES
from lit_mesh.parallel.expert_counts import counts_on_host
from lit_mesh.training.log_steps import is_logging_step, log_every_n_steps

# the host reads a step makes on purpose: {the function that makes it: what it reads}
DECLARED_HOST_READS: dict[Callable, str] = {counts_on_host: MOE_SPLIT_SIZES}  # both dispatchers' (by node: twice)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}  # a wait on, or a wrapper of, one counted already


class _CollectiveCounter(TorchDispatchMode):
    """Counts collectives by op and group size. A dispatch mode is off while an op it saw runs, so it would miss
    the collectives DTensor issues inside an op (e.g. the Partial -> Replicate reduction of a gradient norm):
    while active, DTensor's argument redistribution runs under the mode again."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self._redistribute: Callable | None = None

    def __enter__(self) -> _CollectiveCounter:
        self._redistribute = OpDispatcher.__dict__["redistribute_local_args"]  # a staticmethod
        original, counter = OpDispatcher.redistribute_local_args, self

        def redistribute_under_the_mode(*args: Any, **kwargs: Any) -> Any:
            if counter in _get_current_dispatch_mode_stack():
                return original(*args, **kwargs)
            with counter:
                return original(*args, **kwargs)

        OpDispatcher.redistribute_local_args = staticmethod(redistribute_under_the_mode)  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._redistribute is not None:
            OpDispatcher.redistribute_local_args = self._redistribute  # type: ignore[method-assign]
            self._redistribute = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in _COLLECTIVE_NAMESPACES and func._opname not in _NOT_COLLECTIVES:
            self.calls[f"{func._opname}@{_size_of_group(args)}"] += 1
        return func(*args, **(kwargs or {}))


def _size_of_group(args: tuple) -> int | str:
    # c10d ops carry their ProcessGroup; functional collectives its name, their last str argument
    groups: list[Any] = [a for a in args if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))]
    groups = groups or [a for a in args if isinstance(a, str)][-1:]
    try:
        return _group_size(_group_name(groups[0]))
    except Exception:  # noqa: BLE001 - not a group after all
        return "?"


class StepAudit(Callback):
    """Audits training step `step` (a step that logs nothing: checked), writes `out` (JSON, rank 0) at the end.

    counts (per rank, in `self.counts`): {"host_syncs": n, "host_sync_sites": {site: n}, "declared_host_reads":
    {what: n}, "token_count_copies": n (the MoE split-size reads), "collectives": {"op@group_size": n}}; the file
    holds every rank's counts plus the world size and MoE layers.
    """

    def __init__(self, step: int = 2, out: str | None = None) -> None:
        self.step = step
        self.out = out
        self.counts: dict[str, Any] | None = None
        self._active: tuple[_CollectiveCounter, HostSyncCounter] | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.step or self._active is not None or self.counts is not None:
            return
        if is_logging_step(trainer):
            raise ValueError(
                f"StepAudit(step={self.step}) is a logging step (log_every_n_steps={log_every_n_steps(trainer)});"
                " audit a step that logs nothing"
            )
        optimizer_counters = frozenset(
            id(state["step"])
            for opt in trainer.optimizers
            for state in opt.state.values()
            if isinstance(state.get("step"), torch.Tensor)
        )
        syncs = HostSyncCounter(DECLARED_HOST_READS, ignore=optimizer_counters).__enter__()
        counter = _CollectiveCounter()
        counter.__enter__()
        self._active = (counter, syncs)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._active is None:
            return
        counter, syncs = self._stop()
        self.counts = {
            "host_syncs": syncs.total,
            "host_sync_sites": dict(syncs.sites),
            "declared_host_reads": dict(syncs.declared_counts),
            "token_count_copies": syncs.declared_counts[MOE_SPLIT_SIZES],
            "collectives": dict(counter.calls),
        }

    def _stop(self) -> tuple[_CollectiveCounter, HostSyncCounter]:
        assert self._active is not None
        counter, syncs = self._active
        counter.__exit__(None, None, None)
        syncs.__exit__(None, None, None)
        self._active = None
        return counter, syncs

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._active is not None:
            self._stop()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.out is None:
            return
        if self.counts is None:
            raise RuntimeError(f"StepAudit: step {self.step} never ran (max_steps={trainer.max_steps})")
        ranks: list[Any] = [self.counts]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, self.counts)
        if trainer.global_rank == 0:
            layers = [m for m in pl_module.modules() if type(m).__name__ == "MoE"]
            report = {"step": self.step, "world_size": trainer.world_size, "moe_layers": len(layers), "ranks": ranks}
            Path(self.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.out).write_text(json.dumps(report, indent=1))
