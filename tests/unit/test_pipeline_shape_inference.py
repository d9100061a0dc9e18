"""A later pipeline stage's shape inference computes on zeros, the same on every rank (lit_mesh/parallel/pipeline/
torch_stage.py): torch materialises its input from metadata with uninitialised memory, modelled here by NaNs, which
made the tp ranks of a Mixtral stage route different tokens (a gloo size mismatch on 8 ranks, pp2 x tp2 x ep2)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _StageForwardMeta, extract_tensor_meta

from lit_mesh.parallel.pipeline.torch_stage import ZeroFilledStage


class _Recording(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.detach().clone())
        return self.linear(x)


@pytest.fixture
def second_rank() -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _inference_input(stage_class: type[PipelineStage], monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """What the last of 2 stages computes on in torch's forward metadata inference, the previous stage's output
    metadata received (a (2, 4) activation) and uninitialised memory full of NaNs."""
    module = _Recording()
    stage = stage_class(module, 1, 2, torch.device("cpu"))
    activation = extract_tensor_meta(torch.randn(2, 4, requires_grad=True))
    monkeypatch.setattr(stage, "_recv_meta", lambda _source: _StageForwardMeta(forward_metas=(activation,)))
    empty_strided = torch.empty_strided

    def uninitialised(*args: Any, **kwargs: Any) -> torch.Tensor:
        return empty_strided(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty_strided", uninitialised)
    stage._forward_metadata_inference(None, has_backward=True)
    (seen,) = module.inputs
    assert seen.shape == (2, 4)
    return seen


def test_later_stage_infers_shapes_on_zeros(second_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert torch.equal(_inference_input(ZeroFilledStage, monkeypatch), torch.zeros(2, 4))


def test_torch_stage_infers_shapes_on_uninitialised_memory(second_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # why ZeroFilledStage exists: should torch fill these itself one day, this fails and the subclass can go
    assert _inference_input(PipelineStage, monkeypatch).isnan().all()
