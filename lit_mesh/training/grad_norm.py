"""Gradient clipping by the true global norm of plain, sharded (FSDP) and tensor-parallel (DTensor) grads.

torch.nn.utils.clip_grad_norm_ cannot stack norms of DTensors that live on different meshes (e.g. TP
weights on (dp, tp) beside norms on (dp,)), so each (mesh, placements) group is reduced on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# DTensor logs a warning for every 2D norm it reduces in two steps; expected here, once per group
_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


def _mesh_groups(parameters: Iterable[torch.Tensor], by_dtype: bool = False) -> list[list[torch.Tensor]]:
    """The gradients, grouped so that one foreach call can take each group: by (mesh, placements) of DTensors
    (plain tensors in a group of their own), and by device and dtype where asked."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            continue
        key: object = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        if by_dtype:
            key = (key, p.grad.device, p.grad.dtype)
        groups.setdefault(key, []).append(p.grad)
    return list(groups.values())


@torch.no_grad()
def global_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, across: Optional[dist.ProcessGroup] = None
) -> torch.Tensor:
    """The norm of all gradients as if they were whole on one device.

    `across`: a group whose ranks hold *different* parameters (pipeline stages): their norms are combined too.
    """
    total = _local_norm(list(parameters), norm_type)
    if across is None:
        return total
    if norm_type == float("inf"):
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=across)
        return total
    powered = total.pow(norm_type)
    dist.all_reduce(powered, group=across)
    return powered.pow(1.0 / norm_type)


def _local_norm(parameters: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    groups = _mesh_groups(parameters)
    if not groups:
        # no gradients on this rank (2BW's first step, a stage after a resume): a zero on the parameters' device,
        # where the others' norms are (NCCL refuses a host tensor in the all-reduce over the stages)
        return torch.zeros((), device=parameters[0].device if parameters else None)
    norms = []
    level = _REDISTRIBUTE_LOG.level
    _REDISTRIBUTE_LOG.setLevel(logging.ERROR)
    try:
        for grads in groups:
            norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=True)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    finally:
        _REDISTRIBUTE_LOG.setLevel(level)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    across: Optional[dist.ProcessGroup] = None,
    norm_of: Optional[Iterable[torch.Tensor]] = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before clipping.

    `norm_of`: the parameters whose gradients make the norm (default: all; a pipeline stage's copy of a tied
    parameter counts on one rank only), all of `parameters` being scaled."""
    parameters = list(parameters)  # those without gradients too: they tell a rank without any its device
    total = global_grad_norm(parameters if norm_of is None else list(norm_of), norm_type, across)
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in _mesh_groups(parameters, by_dtype=True):  # one multi-tensor kernel per group
        torch._foreach_mul_(grads, scale.to(device=grads[0].device, dtype=grads[0].dtype))
    return total
