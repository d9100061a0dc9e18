"""Count the bytes every collective of a training step sends, by process group.

A TorchDispatchMode sees both the c10d ops (FSDP2's all-gathers and reduce-scatters, DDP all-reduces,
send/recv) and the functional collectives DTensor issues for TP/SP, with their tensors and groups. Our own:
torch's CommDebugMode counts calls per op but not bytes per group.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


def _group_name(group: Any) -> str:
    if isinstance(group, str):
        return group
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return group.group_name


def _group_size(name: str) -> int:
    return dist.get_world_size(dist.distributed_c10d._resolve_process_group(cast("GroupName", name)))


# Bytes one rank sends, as a fraction of a tensor size, for ring algorithms over n ranks:
# all-reduce 2(n-1)/n of the tensor, all-gather (n-1)/n of the output, reduce-scatter (n-1)/n of the input.
_RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}

# op name -> (kind, index of the tensor whose size counts, index of the group argument)
_C10D = {
    "allreduce_": ("all_reduce", 0, 1),
    "allreduce_coalesced_": ("all_reduce", 0, 1),
    "_allgather_base_": ("gather", 0, 2),
    "allgather_": ("gather", 0, 2),
    "allgather_into_tensor_coalesced_": ("gather", 0, 2),
    "_reduce_scatter_base_": ("scatter", 1, 2),
    "reduce_scatter_": ("scatter", 1, 2),
    "reduce_scatter_tensor_coalesced_": ("scatter", 1, 2),
    "alltoall_base_": ("all_to_all", 1, 2),
    "broadcast_": ("broadcast", 0, 1),
    "reduce_": (
        "reduce",
        0,
        1,
    ),  # to one rank: a broadcast run backwards (SUMMA's backward, lit_mesh/parallel/grid/summa.py)
    "send": ("send", 0, 1),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0, 2),
    "all_reduce_coalesced": ("all_reduce", 0, 2),
    "reduce_scatter_tensor": ("scatter", 0, 3),
    "reduce_scatter_tensor_coalesced": ("scatter", 0, 3),
    "all_to_all_single": ("all_to_all", 0, 3),
    "broadcast": ("broadcast", 0, 2),
}
_FUNCTIONAL_GATHER = {"all_gather_into_tensor", "all_gather_into_tensor_coalesced"}  # input size x n = output


class CollectiveBytes(TorchDispatchMode):
    """While active, `sent[group_name]` accumulates the bytes this rank sends (ring-algorithm model)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        namespace, name = func.namespace, func._opname
        if namespace == "c10d" and name in _C10D:
            self._count(*_C10D[name], args)
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            self._count(*_FUNCTIONAL[name], args)
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL_GATHER:
            n = args[1]
            self.sent[_group_name(args[2])] += _nbytes(args[0]) * (n - 1)
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str, tensor_index: int, group_index: int, args: tuple) -> None:
        group = _group_name(args[group_index])
        size = _nbytes(args[tensor_index])
        n = _group_size(group)
        if n <= 1:
            return
        if kind in _RING_FACTOR:
            self.sent[group] += size * _RING_FACTOR[kind](n)
        elif kind in ("all_to_all", "broadcast", "reduce"):  # even splits / pipelined ring: all but one share leaves
            self.sent[group] += size * (n - 1) / n
        else:  # send: the tensor once
            self.sent[group] += size
