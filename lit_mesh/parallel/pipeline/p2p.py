"""Point-to-point between pipeline stages, for the loops lit-mesh drives itself (evaluation's forward-only pass and
2bw): a tensor goes with a header (dtype, dims, shape), so the receiver needs no shape agreed beforehand. torch's
schedules (training) exchange activations through their own PipelineStage."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_MAX_DIMS = 8


def send_with_header(tensor: Tensor, to: int, group: dist.ProcessGroup) -> list[Any]:
    """Non-blocking: the works of the header and of the tensor (wait on both before reusing `tensor`)."""
    tensor = tensor.contiguous()
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
    return [dist.isend(header, group=group, group_dst=to), dist.isend(tensor, group=group, group_dst=to)]


def recv_with_header(source: int, device: torch.device, group: dist.ProcessGroup) -> Tensor:
    """Blocking: the tensor `source` sent with send_with_header."""
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=source)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(tensor, group=group, group_src=source)
    return tensor
