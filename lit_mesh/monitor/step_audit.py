"""StepAudit: count what one training step that logs nothing costs beyond its compute.

Between on_train_batch_start and on_train_batch_end of the audited step, on every rank:
- host syncs: Python calls of Tensor.item / tolist / __bool__ / cpu (the optimizer's own `step` counters
  excluded: torch keeps them on the host), with the call sites;
- collectives: every c10d op (FSDP2, DDP, send/recv, barrier) and functional collective (DTensor: TP, SP), with
  its process group's size;
- MoE token-count copies: Tensor.tolist calls made from lit_mesh/parallel/expert.py and zoo/moe.py, counted
  apart (data-dependent split sizes must reach the host), so that a test can bound them by the MoE layers.
On CPU these calls cost nothing; on a GPU each host read waits for the queued kernels (a stream sync) and each
collective is a kernel launch and a wait. Counting the calls is the CPU stand-in for that cost.
Our own: torch's CommDebugMode counts functional collectives and c10d ops, but not host reads.
"""

from __future__ import annotations

import json
import traceback
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
from lit_mesh.training.log_steps import is_logging_step, log_every_n_steps

HOST_READS = ("item", "tolist", "__bool__", "cpu")
_TOKEN_COUNT_FILES = ("lit_mesh/parallel/expert.py", "zoo/moe.py")
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

    counts (per rank, in `self.counts`): {"host_syncs": n, "host_sync_sites": {site: n}, "token_count_copies": n,
    "collectives": {"op@group_size": n}}; the file holds every rank's counts plus the world size and MoE layers.
    """

    def __init__(self, step: int = 2, out: str | None = None) -> None:
        self.step = step
        self.out = out
        self.counts: dict[str, Any] | None = None
        self._active: tuple[_CollectiveCounter, dict[str, Callable]] | None = None
        self._sites: Counter[str] = Counter()
        self._token_copies = 0
        self._optimizer_counters: set[int] = set()

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
        self._optimizer_counters = {
            id(state["step"])
            for opt in trainer.optimizers
            for state in opt.state.values()
            if isinstance(state.get("step"), torch.Tensor)
        }
        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        for name, original in originals.items():
            setattr(torch.Tensor, name, self._counting(name, original))
        counter = _CollectiveCounter()
        counter.__enter__()
        self._active = (counter, originals)

    def _counting(self, name: str, original: Callable) -> Callable:
        audit = self

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if id(tensor) not in audit._optimizer_counters:
                frame = traceback.extract_stack(limit=2)[0]
                site = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} {name}"
                if name == "tolist" and frame.filename.replace("\\", "/").endswith(_TOKEN_COUNT_FILES):
                    audit._token_copies += 1
                else:
                    audit._sites[site] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._active is None:
            return
        counter = self._stop()
        self.counts = {
            "host_syncs": sum(self._sites.values()),
            "host_sync_sites": dict(self._sites),
            "token_count_copies": self._token_copies,
            "collectives": dict(counter.calls),
        }

    def _stop(self) -> _CollectiveCounter:
        assert self._active is not None
        counter, originals = self._active
        counter.__exit__(None, None, None)
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        self._active = None
        return counter

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
