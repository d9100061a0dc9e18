"""No weight set in configure_model is silently lost on the meta device.

MeshStrategy builds configure_model's modules on the meta device (each rank then allocates only its shards).
A write into a meta tensor does nothing, so values set there (a `load_state_dict`, a `fill_`, a custom init)
would be replaced at materialisation without a word. `record_meta_writes` watches configure_model (a
TorchFunctionMode: torch has no maintained deferred init to do this for us) and `carry_meta_writes`, called
by materialisation once the weights exist, replays what the user set and refuses what it cannot carry:

- values from real tensors (load_state_dict, copy_ from a loaded tensor): replayed, whatever the module;
- in-place writes made after the modules were built (p.fill_(0.5), p.mul_(2), ...): replayed;
- initialisation inside a module's own reset_parameters(): redone by materialisation (nothing to carry);
- other initialisation while a module is being built (custom init in __init__): superseded by the init rules
  of a module that declares a parallel_plan() (or transformers' own init); for any other module it cannot be
  redone, so it is refused with the fix.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

# in-place by name but not writing values (metadata, autograd flags)
_NOT_WRITES = {
    "requires_grad_",
    "share_memory_",
    "detach_",
    "resize_",
    "as_strided_",
    "squeeze_",
    "unsqueeze_",
    "t_",
    "transpose_",
    "swapdims_",
    "swapaxes_",
    "set_",
    "retain_grad",
    "record_stream",
    "resize_as_",
}
_ATTRIBUTE = "_lit_mesh_meta_writes"  # on the LightningModule, between configure_model and materialisation
WriteKind = Literal["data", "after_build", "construction"]


class MetaInitError(RuntimeError):
    """A value set on the meta device that materialisation cannot carry; the message says what to do."""


@dataclass
class MetaWrite:
    """One in-place write into a meta tensor during configure_model."""

    target: Tensor  # kept alive: its storage identifies the weight
    op: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    kind: WriteKind
    where: str  # the function that wrote it, e.g. "MyNet.__init__"
    name: str = ""  # the weight's name in the LightningModule, once resolved
    # offset in the weight, size, stride
    view: tuple[int | torch.SymInt, tuple[int, ...], tuple[int, ...]] = (0, (), ())

    def describe(self) -> str:
        return f"{self.name}.{self.op.__name__}() in {self.where}"


@dataclass
class MetaWrites:
    """What configure_model wrote into meta weights, and which modules were on meta before it ran."""

    writes: list[MetaWrite] = field(default_factory=list)
    meta_before: set[int] = field(default_factory=set)  # ids of modules built on meta before configure_model


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _module_frame(target: Tensor) -> tuple[str, bool] | None:
    """Where the write comes from: (the function, whether it is the owning module's own reset_parameters),
    or None for torch.distributed internals (FSDP/TP moving meta shards around: no user value).
    The innermost module constructor or reset_parameters decides; configure_model itself means the user."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_name
        if "/torch/distributed/" in frame.f_code.co_filename:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and name in ("__init__", "reset_parameters", "_reset_parameters"):
            storage = _storage(target)
            direct = (*owner._parameters.values(), *owner._buffers.values())
            own = name == "reset_parameters" and any(t is not None and _storage(t) == storage for t in direct)
            return f"{type(owner).__name__}.{name}", own
        if name == "configure_model":
            return f"{type(owner).__name__}.configure_model", False
        frame = frame.f_back
    return "configure_model", False


class _Recorder(TorchFunctionMode):
    def __init__(self, writes: list[MetaWrite]) -> None:
        super().__init__()
        self.writes = writes

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        writes_in_place = name == "__setitem__" or (
            name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES
        )
        if writes_in_place and args and isinstance(args[0], Tensor) and args[0].is_meta:
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        target = args[0]
        sources = [t for t in tree_leaves((args[1:], kwargs)) if isinstance(t, Tensor)]
        if any(t.is_meta for t in sources):
            return  # a value computed on meta (init, tying): nothing real to carry
        origin = _module_frame(target)
        if origin is None:
            return
        where, own_reset = origin
        if sources:  # loaded values, from wherever
            kind: WriteKind = "data"
        elif own_reset:
            return  # materialisation runs reset_parameters() again
        else:
            kind = "after_build" if where.endswith("configure_model") else "construction"
        self.writes.append(MetaWrite(target, func, args, kwargs, kind, where))


def _meta_modules(root: nn.Module) -> set[int]:
    return {id(m) for m in root.modules() if any(t.is_meta for t in (*m.parameters(False), *m.buffers(False)))}


@contextmanager
def record_meta_writes(root: nn.Module) -> Iterator[None]:
    """configure_model on the meta device, its writes into meta weights recorded on `root` for materialisation."""
    record = getattr(root, _ATTRIBUTE, None) or MetaWrites(meta_before=_meta_modules(root))
    new: list[MetaWrite] = []
    with warnings.catch_warnings(), torch.device("meta"), _Recorder(new):
        # torch's "copying ... to a meta parameter ... is a no-op" is not true here: the value is carried
        warnings.filterwarnings("ignore", message=r".*to a meta parameter in the current model.*")
        yield
    _resolve(root, new)
    record.writes += new
    root.__dict__[_ATTRIBUTE] = record


def _resolve(root: nn.Module, writes: list[MetaWrite]) -> None:
    """Name each written tensor by the weight it belongs to; a loaded value whose weight is gone is refused."""
    weights: dict[int, tuple[str, Tensor]] = {}
    for name, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        if not isinstance(t, DTensor) and t.is_meta:
            weights.setdefault(_storage(t), (name, t))
    lost = []
    for write in writes:
        found = weights.get(_storage(write.target))
        if found is None:
            if write.kind == "data" or isinstance(write.target, nn.Parameter):
                lost.append(f"{write.op.__name__}() in {write.where}")
            continue
        write.name, weight = found
        t = write.target
        write.view = (t.storage_offset() - weight.storage_offset(), tuple(t.shape), tuple(t.stride()))
    writes[:] = [w for w in writes if w.name]
    if lost:
        raise MetaInitError(
            f"configure_model wrote values into meta-device weights that the model no longer holds ({lost[:3]}):"
            " on the meta device such a write does nothing, and the weight was then replaced (fully_shard or"
            " parallelize_module) before MeshStrategy could carry the value over. Build the model with real"
            " weights (in __init__, or under trainer.init_module() without empty_init=True), or load the values"
            " after setup (Trainer.fit(ckpt_path=...), or in on_fit_start)"
        )


def built_on_meta_where(root: nn.Module, module: nn.Module) -> str:
    """Where a meta module came from, for error messages that tell the truth."""
    record = getattr(root, _ATTRIBUTE, None)
    if record is not None and id(module) not in record.meta_before:
        return "built in configure_model"
    return "built on the meta device outside configure_model (trainer.init_module(empty_init=True) or torch.device('meta'))"


@torch.no_grad()
def carry_meta_writes(root: nn.Module, initialised_by_plan: set[nn.Module]) -> None:
    """After materialisation: replay the recorded writes on the real weights (whole tensors, then each rank
    keeps its shards, so the result does not depend on the layout), or refuse those that cannot be carried."""
    record: MetaWrites | None = root.__dict__.pop(_ATTRIBUTE, None)
    if record is None or not record.writes:
        return
    owner_of = {name: root.get_submodule(name.rpartition(".")[0]) for name in {w.name for w in record.writes}}
    refused = [w for w in record.writes if w.kind == "construction" and owner_of[w.name] not in initialised_by_plan]
    if refused:
        raise MetaInitError(
            "configure_model built modules on the meta device whose constructors set weights themselves, outside"
            f" the module's reset_parameters(): {[w.describe() for w in refused[:4]]}. On the meta device these"
            " values are lost, and materialisation can only redo reset_parameters() or a parallel_plan()'s init"
            " rules. Build the model in the LightningModule's __init__ (or under trainer.init_module() without"
            " empty_init=True) so that its weights are real, move the initialisation into reset_parameters(),"
            " or declare a parallel_plan() with init rules"
        )
    whole: dict[str, Tensor] = {}
    for write in record.writes:
        if write.kind == "construction":
            continue  # initialised by the plan's rules instead
        if write.name not in whole:
            weight = _weight(root, write.name)
            whole[write.name] = weight.full_tensor() if isinstance(weight, DTensor) else weight.data
        offset, size, stride = write.view
        target = whole[write.name].as_strided(size, stride, whole[write.name].storage_offset() + offset)
        write.op(target, *write.args[1:], **write.kwargs)
    for name, values in whole.items():
        weight = _weight(root, name)
        if isinstance(weight, DTensor):
            local = distribute_tensor(values, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
            weight.to_local().copy_(local)


def _weight(root: nn.Module, name: str) -> Tensor:
    module_name, _, leaf = name.rpartition(".")
    module = root.get_submodule(module_name)
    # a named parameter or buffer: never None
    return cast(Tensor, module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf])
