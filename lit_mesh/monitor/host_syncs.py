"""HostSyncCounter: count the calls that make the host wait for the device (a stream sync on CUDA).

Three kinds, each seen where it can be seen on any device:
- host reads by Python call: Tensor.item / tolist / __bool__ / cpu (patched on torch.Tensor while counting);
- ops whose output shape depends on device values, so the host must read them (seen as aten ops by a dispatch
  mode): nonzero, boolean-mask indexing (index / index_put with a bool index), masked_select, unique,
  repeat_interleave without output_size, equal;
- host data sent to the device (seen as torch calls by a function mode): torch.tensor / as_tensor / asarray of
  Python data with a device given, and a move (to / cuda / copy_) of a tensor that lives on the host (a CPU tensor
  moved to another device type, or one made from host data in the counted region without a device).

Limits (on CPU nothing really waits, so this is a proxy; torch.cuda.set_sync_debug_mode("warn") on a GPU is the
judge): on a CPU rank a tensor made before counting started without a device (a module-level constant) is on the
"device" already, so its move is seen only where it is moved to another device type (a test may use "meta"), and
torch's own calls with device="cpu" (the optimizer's host step counters) are taken as meant for the host; a read
made in C++ without one of the ops above (float(t), int(t), a kernel that reads a scalar) is not seen, nor is a
read inside an op that DTensor dispatches (the DTensor op itself is seen).

A read made inside a function named in `declared` is counted apart, under that function's description: a sync
the code means to make (the all-to-all split sizes of an MoE layer under expert parallel).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

HOST_READS = ("item", "tolist", "__bool__", "cpu")
_aten = torch.ops.aten
# aten ops that read device values on the host (their output's size depends on them, or they return a bool)
_VALUE_READING_OPS = {
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique.default: "unique",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.equal.default: "equal",
}
_INDEXING_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
_HOST_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}
_THIS_FILE = __file__
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"


class HostSyncCounter:
    """A context manager: while open, counts host syncs (module doc) by call site in `sites` ({"file:line what": n})
    and the declared ones in `declared_counts` ({description: n}). `declared`: {function: description}; `ignore`:
    ids of tensors whose reads are no sync (the optimizer's host-side step counters)."""

    def __init__(self, declared: Optional[dict[Callable, str]] = None, ignore: frozenset[int] = frozenset()) -> None:
        self.declared: dict[CodeType, str] = {f.__code__: what for f, what in (declared or {}).items()}
        self.ignore = ignore
        self.sites: Counter[str] = Counter()
        self.declared_counts: Counter[str] = Counter()
        self.host_made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.read_storages: dict[int, StorageWeakRef] = {}  # what declared cpu() reads returned, by storage
        self._originals: dict[str, Callable] = {}
        self._reading = False
        self._modes: tuple[_HostDataMode, _ValueReadMode] | None = None

    def read_already(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` holds what a declared read brought to the host (reading it again waits for nothing)."""
        ref = self.read_storages.get(tensor.untyped_storage()._cdata) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and not ref.expired()

    @property
    def total(self) -> int:
        """Undeclared syncs counted so far."""
        return sum(self.sites.values())

    def count(self, what: str, frame: Optional[FrameType]) -> bool:
        """Count one sync at `frame`; True where it is a declared one."""
        site = None
        while frame is not None:
            declared = self.declared.get(frame.f_code)
            if declared is not None:
                self.declared_counts[declared] += 1
                return True
            name = frame.f_code.co_filename
            if site is None and name != _THIS_FILE and not name.startswith(_TORCH_DIR):
                site = f"{name.split('site-packages/')[-1]}:{frame.f_lineno} {what}"
            frame = frame.f_back
        self.sites[site or what] += 1
        return False

    def __enter__(self) -> HostSyncCounter:
        self._originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counting(name, original))
        self._modes = (_HostDataMode(self), _ValueReadMode(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._modes is not None:
            for mode in reversed(self._modes):
                mode.__exit__(*exc)
            self._modes = None
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals = {}

    def _counting(self, name: str, original: Callable) -> Callable:
        counter = self

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # the function mode hands the call back to this (patched) method: count the outer call only; what a
            # declared cpu() brought to the host is read there without a sync (on a CPU rank cpu() returns the
            # tensor itself: only a declared read's own result is marked)
            if counter._reading or id(tensor) in counter.ignore or counter.read_already(tensor):
                return original(tensor, *args, **kwargs)
            declared = counter.count(name, sys._getframe(1))
            counter._reading = True
            try:
                out = original(tensor, *args, **kwargs)
            finally:
                counter._reading = False
            if declared and name == "cpu" and isinstance(out, torch.Tensor):
                storage = out.untyped_storage()  # views and detached copies (a checkpoint's stored one) share it
                counter.read_storages[storage._cdata] = StorageWeakRef(storage)
            return out

        return counted


def _is_host_data(data: Any) -> bool:
    return not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(data)[0])


def _made_by_torch(caller: FrameType) -> bool:
    # torch's own host tensors: e.g. the optimizer's step counter increments, torch.tensor(1.0, device="cpu")
    return caller.f_code.co_filename.startswith(_TORCH_DIR)


def move_target(func: Any, args: tuple, kwargs: dict) -> Optional[torch.device]:
    """Where a to / cuda / copy_ call moves its tensor (None: only a dtype change)."""
    if func is torch.Tensor.cuda:
        return torch.device("cuda")
    if func is torch.Tensor.copy_:
        return args[0].device
    device = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
    return torch.device(device) if device is not None else None


class _HostDataMode(TorchFunctionMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _HOST_DATA_FACTORIES and args and _is_host_data(args[0]):
            device = kwargs.get("device")
            if device is not None and (torch.device(device).type != "cpu" or not _made_by_torch(sys._getframe(1))):
                self.counter.count("host data to device", sys._getframe(1))
            elif isinstance(out, torch.Tensor):
                self.counter.host_made[out] = True
        elif func in _MOVES:
            source = args[1] if func is torch.Tensor.copy_ else args[0]
            target = move_target(func, args, kwargs)
            if isinstance(source, torch.Tensor) and target is not None:
                off_host = source.device.type == "cpu" and target.type != "cpu"
                if off_host or (source in self.counter.host_made and target.type == source.device.type):
                    self.counter.count("host to device copy", sys._getframe(1))
        return out


def _reads_a_mask(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an index / index_put turns a boolean mask into positions (its nonzero). torch runs t[mask] = scalar
    as masked_fill (no read): one mask index, a one-element value, no accumulation."""
    indices = [i for i in (args[1] if len(args) > 1 else ()) if i is not None]
    if not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return False
    if func is _aten.index.Tensor:
        return True
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return not (len(indices) == 1 and args[2].numel() == 1 and not accumulate)


class _ValueReadMode(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        what = _VALUE_READING_OPS.get(func)
        if func in _INDEXING_OPS and _reads_a_mask(func, args, kwargs):
            what = "boolean-mask indexing"
        if (
            func is _aten.repeat_interleave.Tensor
            and kwargs.get("output_size", args[1] if len(args) > 1 else None) is None
        ):
            what = "repeat_interleave without output_size"
        if what is not None:
            self.counter.count(what, sys._getframe(1))
        return func(*args, **kwargs)
