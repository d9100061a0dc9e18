"""Sequence parallelism without activation checkpointing: the gathered inputs re-gathered in backward.

Under SP a region (attention, MLP) all-gathers its sequence-sharded input once (the `gather_input` style,
lit_mesh/parallel/hidden_states.py) and hands the whole sequence to its column-parallel linears, which autograd
would keep for their weight gradients: dim elements per token per region, the largest tensor a block keeps. Here a
block that is not checkpointed keeps only its tp rank's sequence shard of each such tensor and all-gathers it again
when backward first needs it, once for all the linears that share it (wq, wk, wv), as Megatron-Core's
sequence-parallel linear does. The numerics are bit-identical: the backward gathers the same shards the forward did.

Why saved-tensor hooks and not our own linear: the linears stay torch's (DTensor's ColwiseParallel, float8's,
a transformers model's own Conv1D), FSDP2 and the TP styles see nothing new, and the tensors to replace are
known by construction: the storage of each tensor the gather_input style all-gathered inside the block's forward
(`note_gathered`), not guessed from shapes. Whatever else autograd saves passes through untouched.
Checkpointed blocks are left alone (AC recomputes them, and its own hooks must see every saved tensor), and so are
compiled blocks (the gather then happens inside the compiled graph, where no hook can name its output). Saved-tensor
hooks around the block (the user's save_on_cpu, a memory probe) still get every other tensor the block saves.

NCCL: the re-gathers run inside autograd's backward of the block, each at the first node that unpacks its tensor.
Every tp rank runs the same graph (the same modules on the same sequence length), and autograd's engine orders
ready nodes by their creation order, so every tp rank issues these all-gathers, and the tp group's other
collectives, in the same order; they are DTensor's own asynchronous all-gathers, waited on by the matmul that
uses them, with no host sync.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.hooks import RemovableHandle

from lit_mesh.parallel.pipeline.schedules import SPLIT_BACKWARD

_SCOPES = threading.local()  # the block forwards in progress on this thread, innermost last


class _Gathered:
    """One all-gathered input: its shard (kept), and the whole tensor while the forward or a backward uses it."""

    def __init__(self, shard: DTensor, gathered: DTensor, storage: int) -> None:
        self.shard: DTensor = cast(DTensor, shard.detach())
        # a DTensor's detach() does not share its local tensor's version counter: watch the forward's own local
        self.watched = shard._local_tensor
        self.version = self.watched._version
        self.layout = _layout(gathered._local_tensor)
        self.whole: torch.Tensor | None = gathered._local_tensor
        self.storage = storage
        self.saved = 0  # the saved tensors of autograd that refer to it and are not yet unpacked

    def gather(self) -> torch.Tensor:
        """The whole local tensor: gathered again the first time a backward unpacks a tensor of it."""
        if self.whole is None:
            if self.watched._version != self.version:
                raise RuntimeError(
                    "a sequence-parallel input kept for backward was modified in place after the forward; its"
                    " re-gather would differ from the tensor the forward used (do not modify a norm's output in place)"
                )
            whole = self.shard.redistribute(placements=(Replicate(),))._local_tensor
            if _layout(whole) != self.layout:  # same collective, same shards: a torch change would show here
                raise RuntimeError(f"re-gathered {_layout(whole)} where the forward gathered {self.layout}")
            self.whole = whole
        return self.whole

    def unpacked(self) -> None:
        self.saved -= 1
        if self.saved <= 0:  # the last linear that shares it has its tensor: free the whole one with it
            self.whole = None


def _storage_pointer(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass (a functional collective's pending result) has no storage of its own
        return None


def _layout(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())


@dataclass
class _Saved:
    """What autograd keeps in place of a view of a gathered tensor: how to rebuild that view."""

    source: _Gathered
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: Any = None  # the DTensor's (mesh, placements, shape, stride); None for a plain tensor


@dataclass
class _Outer:
    """A tensor packed by the hooks around the block (e.g. the user's torch.autograd.graph.save_on_cpu)."""

    packed: Any
    unpack: Any


@dataclass
class _Scope:
    """One block forward: the tensors gathered in it so far, and the saved-tensor hooks around the block (this
    scope's hooks hide them inside the block: every tensor that is not a gathered one is handed to them)."""

    outer: tuple[Any, Any] | None = None
    gathered: list[_Gathered] = field(default_factory=list)

    def pack(self, t: torch.Tensor) -> Any:
        source = self._gathered_source(t)
        if source is None:
            return t if self.outer is None else _Outer(self.outer[0](t), self.outer[1])
        source.saved += 1
        local = t._local_tensor if isinstance(t, DTensor) else t
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return _Saved(source, local.shape, local.stride(), int(local.storage_offset()), spec)

    def _gathered_source(self, t: torch.Tensor) -> _Gathered | None:
        if t.device.type == "meta" or not self.gathered:
            return None
        pointer = _storage_pointer(t._local_tensor if isinstance(t, DTensor) else t)
        return next((g for g in self.gathered if g.whole is not None and g.storage == pointer), None)


def _unpack(packed: Any) -> Any:
    if isinstance(packed, _Outer):
        return packed.unpack(packed.packed)
    if not isinstance(packed, _Saved):
        return packed
    local = packed.source.gather().as_strided(packed.size, packed.stride, packed.offset)
    packed.source.unpacked()
    if packed.spec is None:
        return local
    mesh, placements, shape, stride = packed.spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def note_gathered(shard: DTensor, gathered: DTensor) -> None:
    """The gather_input style all-gathered `shard` into `gathered`: re-gather it in backward if a block that
    re-gathers is running its forward on this thread."""
    if torch.compiler.is_compiling():  # compiled blocks do not re-gather; tracing this would break their graph
        return
    scopes = getattr(_SCOPES, "stack", None)
    pointer = _storage_pointer(gathered._local_tensor)  # None: a pending collective's result, left as it is
    innermost = scopes[-1] if scopes else None
    if innermost is not None and pointer is not None and pointer != _storage_pointer(shard._local_tensor):  # tp > 1
        innermost[0].gathered.append(_Gathered(shard, gathered, pointer))


def _enter(_module: nn.Module, _args: tuple) -> None:
    stack = getattr(_SCOPES, "stack", None)
    if stack is None:
        stack = _SCOPES.stack = []
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]  # disabled: keep whole
        stack.append(None)
        return
    # the hooks around the block, if any (torch has no public way to read them)
    scope = _Scope(outer=torch._C._autograd._top_saved_tensors_default_hooks(False))
    hooks = torch.autograd.graph.saved_tensors_hooks(scope.pack, _unpack)
    hooks.__enter__()
    stack.append((scope, hooks))


def _exit(_module: nn.Module, _args: tuple, _output: Any) -> None:
    entry = _SCOPES.stack.pop()
    if entry is None:
        return
    scope, hooks = entry
    hooks.__exit__(None, None, None)
    for gathered in scope.gathered:  # the forward is done with them: backward gathers them again
        gathered.whole = None


def regathers_under(schedule: str, pp: int) -> bool:
    """Whether the blocks of a pipeline under `schedule` re-gather (always without pp): not under a split backward
    (zero bubble, V schedules), which unpacks each saved tensor twice, for the input and then the weight gradients,
    so each input would be gathered twice."""
    return pp == 1 or schedule not in SPLIT_BACKWARD


def regather_in_backward(block: nn.Module) -> list[RemovableHandle]:
    """Keep only the sequence shards of the inputs `block`'s gather_input regions all-gather, and gather them
    again in backward. For blocks that are neither checkpointed nor compiled (the module docstring says why)."""
    # always_call: the hooks leave the stack even when the forward raises
    return [block.register_forward_pre_hook(_enter), block.register_forward_hook(_exit, always_call=True)]
