"""The 2bw driver's weight versions on one process (a fake process group of 2 ranks, this one the first stage, whose
backwards lag one micro-batch behind): a backward that runs after the optimizer step still differentiates at the
weights its forward used, the gradient handed over at step t is batch t-1's, at most two weight copies are held, and
gradient accumulation is refused. The whole pipeline against a one-process replay: tests/integration/test_pipeline_2bw.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lit_mesh.errors import PipelineConfigError
from lit_mesh.parallel.pipeline.schedules import PipelineSettings
from lit_mesh.parallel.pipeline.split import Stage
from lit_mesh.parallel.pipeline.twobw import TwoBWRunner

STEPS, MICROBATCHES = 4, 2


def network() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))


def snapshot(module: nn.Module) -> nn.Module:
    """A plain copy of the weights (the stage itself carries the runner's hooks)."""
    copy = network()
    copy.load_state_dict({name: value.detach().clone() for name, value in module.state_dict().items()})
    return copy


@pytest.fixture
def first_stage() -> Iterator[tuple[TwoBWRunner, nn.Module]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        module = network()
        settings = PipelineSettings("2bw", microbatches=MICROBATCHES)
        runner = TwoBWRunner(
            [Stage(0, module)],
            settings,
            dist.group.WORLD,
            [0, 1],
            torch.device("cpu"),
            parameters=lambda: list(module.parameters()),
        )
        yield runner, module
    finally:
        dist.destroy_process_group()


def test_backward_after_the_update_uses_the_forwards_weights(first_stage, monkeypatch: pytest.MonkeyPatch) -> None:
    runner, module = first_stage
    upstream = torch.randn(2, 4)  # the gradient the next stage sends back for every micro-batch's output

    def exchange(ops: list[dist.P2POp]) -> list:
        """The stage's batched point-to-point: every receive (a gradient from the next stage) gets `upstream`."""
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.copy_(upstream)
        return []

    monkeypatch.setattr(dist, "batch_isend_irecv", exchange)
    inputs = [torch.randn(2 * MICROBATCHES, 4) for _ in range(STEPS)]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    versions = [snapshot(module)]  # W_0, W_1, ...: what each step's forwards ran with
    handed = []
    for x in inputs:
        runner.begin_step(1)
        with torch.enable_grad():
            loss = runner.loss(lambda out, target: out.sum(), x, x)  # the first stage: its loss is the last stage's
        optimizer.zero_grad()
        loss.backward()  # as Lightning's backward: hands the previous batch's gradient over
        handed.append([None if p.grad is None else p.grad.clone() for p in module.parameters()])
        held, one_copy = runner.weight_storage_bytes()
        assert held == 2 * one_copy, (held, one_copy)
        optimizer.step()
        versions.append(snapshot(module))
    assert all(g is None for g in handed[0]), "step 0 applies nothing"
    for step in range(1, STEPS):  # batch step-1 at W_{step-1}, its last micro-batch's backward run after an update
        at = versions[step - 1]
        at.zero_grad()
        for micro in inputs[step - 1].tensor_split(MICROBATCHES):
            torch.autograd.backward(at(micro), upstream)
        for got, param in zip(handed[step], at.parameters()):
            torch.testing.assert_close(got, param.grad, rtol=0, atol=0)
    assert not torch.equal(versions[1][0].weight, versions[2][0].weight), "updates happened: the check has teeth"
    runner.end_training()  # drains the last batch's backwards: only the live weights remain
    held, one_copy = runner.weight_storage_bytes()
    assert held == one_copy


def test_gradient_accumulation_is_refused(first_stage) -> None:
    runner, _ = first_stage
    with pytest.raises(
        PipelineConfigError, match="pp_schedule='2bw' with accumulate_grad_batches=2: .* set accumulate_grad_batches=1"
    ):
        runner.begin_step(2)
