"""The gather_input style hands its module the region's input as a replicated DTensor (one gather, one gradient
reduction per region: tests/integration/test_tp_bytes.py counts them) and its output on as a plain tensor; a module
that returns a sharded or partial DTensor is refused by name (torch's fake process group, one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from lit_mesh.errors import PlanError
from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.parallel.tensor import torch_style


class Returns(nn.Module):
    """Records the type of its input; returns it as it is, or sharded over the features."""

    def __init__(self, shard_output: bool) -> None:
        super().__init__()
        self.shard_output = shard_output
        self.seen: type | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = type(x)
        return x.redistribute(placements=[Shard(-1)]) if self.shard_output else x


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_gather_input_hands_a_dtensor_in_and_a_plain_tensor_out(sequence_parallel: bool) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        tp = build_device_mesh(MeshLayout(tp=2), "cpu")["tp"]
        style = torch_style("gather_input", sequence_parallel)
        module = style._apply(Returns(shard_output=False), tp)
        out = module(torch.ones(2, 4, 8))
        assert module.seen is DTensor and type(out) is torch.Tensor
        refused = style._apply(Returns(shard_output=True), tp)
        with pytest.raises(PlanError, match=r"Returns \(TP style gather_input\) returns a DTensor placed \(Shard"):
            refused(torch.ones(2, 4, 8))
    finally:
        dist.destroy_process_group()
