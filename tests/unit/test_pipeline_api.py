"""The pipeline's API on one process: loss_of / output_of reach a runner only inside the step scope MeshStrategy
enters (nothing is attached to the model), scopes nest and end with the step, and a stage called outside its
runner is refused with the fix. The whole pipeline: tests/integration/test_pipeline.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lit_mesh.parallel.pipeline import is_pipelined, loss_of, output_of, pipeline_scope
from lit_mesh.parallel.pipeline.schedules import PipelineSettings
from lit_mesh.parallel.pipeline.split import Stage
from lit_mesh.parallel.pipeline.twobw import TwoBWRunner


def _stub(model: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(model=model, loss=lambda fn, x, y: torch.tensor(7.0), output=lambda x: torch.tensor(8.0))


def test_the_runner_is_found_inside_the_scope_only() -> None:
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    x = torch.zeros(2, 2)
    with pipeline_scope(_stub(model)):  # type: ignore[arg-type]
        assert is_pipelined(model) and not is_pipelined(other)
        assert loss_of(model, nn.functional.mse_loss, x, x).item() == 7.0
        with torch.no_grad():
            assert output_of(model, x).item() == 8.0
        with pipeline_scope(_stub(other)):  # type: ignore[arg-type]
            assert is_pipelined(model) and is_pipelined(other)
        assert not is_pipelined(other)
    assert not is_pipelined(model) and not hasattr(model, "_lit_mesh_pipeline")
    assert loss_of(model, nn.functional.mse_loss, x, x).shape == ()  # a plain call again
    with pipeline_scope(None):
        assert not is_pipelined(model)


def test_a_stage_called_outside_a_step_names_the_fix() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        module = nn.Linear(4, 4)
        TwoBWRunner(
            [Stage(0, module)],
            PipelineSettings("2bw", microbatches=2),
            dist.group.WORLD,
            [0, 1],
            torch.device("cpu"),
            parameters=lambda: list(module.parameters()),
        )
        with pytest.raises(
            RuntimeError,
            match=r"one pipeline stage under MeshStrategy\(pp=2\): call it through"
            r" lit_mesh.loss_of\(self.model, loss_fn, inputs, targets\)",
        ):
            loss_of(module, nn.functional.mse_loss, torch.zeros(2, 4), torch.zeros(2, 4))
    finally:
        dist.destroy_process_group()
