"""A test mode in which a host tensor passed to a collective fails on CPU, as it fails on NCCL.

gloo takes CPU tensors in any collective; NCCL raises "No backend type associated with device type cpu". On a CPU
run the rank's device *is* the CPU, so the tensors' devices cannot tell the two apart. The proxy follows where each
tensor was made instead: a tensor made by a factory without `device=` (`torch.tensor(0.0)`, `torch.zeros(n)`, ...)
lands on the host on a GPU rank too, and so does one moved with `.cpu()` or `.to("cpu")`. Such tensors are marked
"host-made"; an op whose tensor inputs are all host-made makes host-made outputs (as on CUDA, where an op on host
tensors runs on the host), an op with any tensor input on the device makes device outputs, and `.to(device)` to the
rank's device clears the mark. A collective (every c10d and functional collective op) that receives a host-made
tensor is recorded with the op, the tensor's shape and where it was made.

Limits (what the proxy cannot see; a GPU run's errors remain the judge):
- tensors made before the mode is entered are not marked (the mode runs per training step: CollectiveDevices);
- tensors made in C++ without a Python call (`torch.ByteTensor(storage)`, a tensor read from a file) are not marked;
- a factory given the device of another tensor (`device=t.device`) is taken as on the device, even where `t` is
  host-made;
- on a CPU rank `t.to(device)` returns `t` itself, so the move clears the mark of `t` too (on a GPU `t` would stay
  on the host): use the moved tensor;
- a host tensor combined with a device tensor counts as on the device, as a 0-dim CPU tensor does on CUDA; a host
  tensor of more than one element combined so would raise on CUDA, which this mode does not report.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from lit_mesh.monitor.host_syncs import move_target

# the factories whose tensors land on the host unless given a device
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.eye,
}
_MOVES_TO_HOST = {torch.Tensor.cpu}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class _Marking(TorchFunctionMode):
    def __init__(self, check: HostTensorCheck) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        host = self.check.host
        if func in FACTORIES:
            given = kwargs.get("device")
            # device="cpu" on a CPU rank is what passing strategy.root_device gives: on the device
            if given is None or (torch.device(given).type == "cpu" and self.check.device.type != "cpu"):
                self.check.mark(out)
            return out
        if func in _MOVES_TO_HOST:
            if self.check.device.type != "cpu":
                self.check.mark(out)
            return out
        if func in _MOVES:
            target = move_target(func, args, kwargs)
            if target is not None:  # an explicit move: host-made only where it moves to the host off a CPU rank
                if target.type == "cpu" and self.check.device.type != "cpu":
                    self.check.mark(out)
                else:
                    self.check.unmark(out)  # on the CPU .to(cpu) returns the tensor itself (see the limits)
                return out
        inputs = _tensors((args, kwargs))
        if inputs and all(t in host for t in inputs):
            self.check.mark(out, site=host[inputs[0]])
        return out


class _Collectives(TorchDispatchMode):
    def __init__(self, check: HostTensorCheck) -> None:
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func.namespace in _COLLECTIVE_NAMESPACES and func._opname not in _NOT_COLLECTIVES:
            for t in _tensors((args, kwargs)):
                if t in self.check.host:
                    self.check.found.append({"op": func._opname, "shape": list(t.shape), "made_at": self.check.host[t]})
        return func(*args, **(kwargs or {}))


class HostTensorCheck:
    """A context manager: while it is open, every collective that receives a host-made tensor (module doc) is
    recorded in `found` ({op, shape, made_at}); `device` is the rank's device (the strategy's root_device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.found: list[dict] = []
        self._modes: tuple[_Marking, _Collectives] | None = None

    def mark(self, value: Any, site: Optional[str] = None) -> None:
        if site is None:
            frames = [f for f in traceback.extract_stack(limit=12) if f.filename != __file__]
            # innermost first: the line that made it, then its two callers
            site = "; ".join(f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(frames[-3:]))
        for t in _tensors(value):
            self.host[t] = site

    def unmark(self, value: Any) -> None:
        for t in _tensors(value):
            self.host.pop(t, None)

    def __enter__(self) -> HostTensorCheck:
        self._modes = (_Marking(self), _Collectives(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._modes is not None
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None


class CollectiveDevices(Callback):
    """HostTensorCheck over every training batch (forward, backward, clipping, optimizer step) but the steps in
    `skip_steps`; at the end of training each rank writes what it found to `out`/rank{r}.json (an empty list: none).
    Skip the step a StepAudit counts: its host-read counters would count the calls this mode re-issues."""

    def __init__(self, out: str, skip_steps: Optional[list[int]] = None) -> None:
        self.out = out
        self.skip_steps = set(skip_steps or [])
        self.check: Optional[HostTensorCheck] = None
        self.found: list[dict] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step not in self.skip_steps:
            self.check = HostTensorCheck(trainer.strategy.root_device).__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self._close(trainer.global_step)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close(trainer.global_step)

    def _close(self, step: int) -> None:
        if self.check is not None:
            self.check.__exit__(None, None, None)
            self.found += [{**f, "step": step} for f in self.check.found]
            self.check = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(self.out).mkdir(parents=True, exist_ok=True)
        (Path(self.out) / f"rank{rank}.json").write_text(json.dumps(self.found, indent=1))
