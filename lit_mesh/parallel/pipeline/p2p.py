"""Point-to-point between pipeline stages, for the loops lit-mesh drives itself (evaluation's forward-only pass and
2bw): a tensor goes with a header (dtype, dims, shape), so the receiver needs no shape agreed beforehand. torch's
schedules (training) exchange activations through their own PipelineStage."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_mesh.errors import PipelineConfigError

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


class StepExchange:
    """The point-to-point of 2bw's own 1F1B loop, as torch's schedules issue theirs (NCCL runs a pair's sends and
    receives on one stream: unbatched sends in both directions between two ranks can deadlock once a message
    outgrows NCCL's buffers):
    - a send is queued, not issued; the next receive issues it in one `batch_isend_irecv` with the receive when both
      go to the same peer (a forward's send to the next stage with the next backward's receive from it; a backward's
      send to the previous stage with the next forward's receive from it), and waits that batch whole; queued sends
      to another peer go first, in a batch of their own;
    - what is still queued at the end of a step goes in one batch, waited at the end of the next step (the receiver
      takes a gradient for the previous stage only at its next step);
    - an activation's shape follows from its micro-batch's (every stage holds the same micro-batches): the first
      activation of each micro-batch shape goes with a header (dtype, shape), read on the host once; later ones are
      received into the shape learnt, with no header and no host read, and a stage whose output for a known
      micro-batch shape changes is refused. Gradients are received into the shape of the output they belong to."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._queued: list[dist.P2POp] = []
        self._unwaited: list[list[tuple[Any, list[Tensor]]]] = [[], []]  # (work, its tensors): last step's, this one's
        # micro-batch (shape, dtype) -> the activation's (dtype, shape): what was sent, what was received
        self._sent: dict[tuple, tuple[torch.dtype, torch.Size]] = {}
        self._received: dict[tuple, tuple[torch.dtype, torch.Size]] = {}

    def send_activation(self, tensor: Tensor, to: int, micro: Tensor) -> None:
        tensor, key = tensor.contiguous(), _key(micro)
        known = self._sent.get(key)
        if known is None:
            self._sent[key] = (tensor.dtype, tensor.shape)
            self._queue(_header(tensor), to)
        elif (tensor.dtype, tensor.shape) != known:
            raise PipelineConfigError(
                f"a pipeline stage's output for a {tuple(micro.shape)} micro-batch was {tuple(known[1])} {known[0]} and is"
                f" now {tuple(tensor.shape)} {tensor.dtype}: pp_schedule='2bw' sends activations of a known shape"
                " without a header, so a stage's output must depend on its micro-batch's shape only"
            )
        self._queue(tensor, to)

    def send_gradient(self, tensor: Tensor, to: int) -> None:
        self._queue(tensor.contiguous(), to)

    def recv_activation(self, source: int, micro: Tensor) -> Tensor:
        key, device = _key(micro), micro.device
        if key not in self._received:
            header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
            self._receive(header, source)
            fields = header.tolist()  # once per micro-batch shape
            self._received[key] = (_DTYPES[fields[0]], torch.Size(fields[2 : 2 + fields[1]]))
        dtype, shape = self._received[key]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        self._receive(tensor, source)
        return tensor

    def recv_gradient(self, like: Tensor, source: int) -> Tensor:
        grad = torch.empty_like(like)
        self._receive(grad, source)
        return grad

    def end_step(self) -> None:
        """Issue what is still queued (waited at the end of the next step), and wait the previous step's."""
        self._issue(self._queued, wait=False)
        self._queued = []
        for work, _tensors in self._unwaited[0]:
            work.wait()
        self._unwaited = [self._unwaited[1], []]

    def _queue(self, tensor: Tensor, to: int) -> None:
        self._queued.append(dist.P2POp(dist.isend, tensor, group=self.group, group_peer=to))

    def _receive(self, tensor: Tensor, source: int) -> None:
        same_peer = [op for op in self._queued if op.group_peer == source]
        self._issue([op for op in self._queued if op.group_peer != source], wait=False)
        self._queued = []
        self._issue([*same_peer, dist.P2POp(dist.irecv, tensor, group=self.group, group_peer=source)], wait=True)

    def _issue(self, ops: list[dist.P2POp], wait: bool) -> None:
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if wait:
            for work in works:
                work.wait()
        else:  # the tensors stay referenced until their sends are waited
            self._unwaited[1] += [(work, [op.tensor for op in ops]) for work in works]


def _key(micro: Tensor) -> tuple:
    return (tuple(micro.shape), micro.dtype)


def _header(tensor: Tensor) -> Tensor:
    """(dtype index, dims, shape...) on the tensor's device, written from host ints (no host-to-device copy)."""
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
        raise PipelineConfigError(
            f"a pipeline stage sends a {tensor.dim()}-dim {tensor.dtype} activation: supported are up to {_MAX_DIMS}"
            f" dims of {', '.join(map(str, _DTYPES))}"
        )
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=tensor.device)
    for i, value in enumerate([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]):
        header[i] = value  # a fill per field: torch.tensor(list, device=...) would copy a pageable host buffer
    return header
