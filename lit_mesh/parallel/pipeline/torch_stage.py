"""torch's PipelineStage, with the inputs of its metadata inference filled with zeros.

Before a schedule's first step (and whenever it switches between step() and eval()), torch runs every stage once
to learn the shapes it sends: the first stage on the real micro-batch, each later stage on a tensor materialised
from the previous stage's metadata with `torch.empty_strided` (torch 2.13), whatever the allocator holds. A stage
whose ranks must compute alike then computes on different garbage per rank: the tp ranks of a stage with an MoE
layer replicated over tp (Mixtral, the zoo MoE) route different tokens, so their expert sums over tp have different
sizes (gloo aborts with "Received data size doesn't match expected size"; NCCL would hang or mix unrelated
buffers). Zeros are the same on every rank, so every rank of a stage routes (and communicates) alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage


class ZeroFilledStage(PipelineStage):
    """A PipelineStage whose metadata inference computes on zeros where torch would leave memory uninitialised."""

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor):  # made from metadata (a real tensor is only detached: kept)
            with torch.no_grad():  # a leaf that may require grad
                tensor.zero_()
        return tensor
