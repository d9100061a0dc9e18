"""MeshStrategy(on_world_change="replan") in one process: the layout a smaller launch gets, global batches served
as micro-batches, loop counters rescaled, and the logged loss of an accumulated step
(lit_mesh/reliability/replan.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_mesh import MeshStrategy
from lit_mesh.errors import MeshConfigError, WorldSizeError
from lit_mesh.mesh import MeshLayout
from lit_mesh.reliability.replan import SPLITS_KEY, keep_global_batch, plan_for_world, rescale_batch_progress
from lit_mesh.training.log_steps import step_mean
from zoo.global_batches import GlobalBatches


def degrees(**given: object) -> dict:
    base = dict(dp=None, dp_replicate=None, dp_shard=None, tp=1, cp=1, pp=1, ep=1)
    return {**base, **given}


@pytest.mark.parametrize(
    ("given", "world", "layout", "splits"),
    [
        (dict(dp=4), 2, MeshLayout(dp_shard=2), 2),
        (dict(dp=4), 1, MeshLayout(), 4),
        (dict(dp=4, tp=2), 4, MeshLayout(dp_shard=2, tp=2), 2),
        (dict(dp_replicate=2, dp_shard=2), 2, MeshLayout(dp_shard=2), 2),  # HSDP loses its replicas first
        (dict(dp_replicate=2, dp_shard=4), 4, MeshLayout(dp_shard=4), 2),
        (dict(dp_replicate=4, dp_shard=2, pp=2), 8, MeshLayout(pp=2, dp_replicate=2, dp_shard=2), 2),
        (dict(dp=8, ep=2), 4, MeshLayout(dp_shard=4, ep=2), 2),
        (dict(dp=4), 4, MeshLayout(dp_shard=4), 1),  # the planned world: nothing to replan
        (dict(tp=2), 2, MeshLayout(tp=2), 1),  # dp fills the world: nothing planned to keep
    ],
)
def test_replan_keeps_model_parallel_and_shrinks_data_parallel(
    given: dict, world: int, layout: MeshLayout, splits: int
) -> None:
    plan = plan_for_world(world, degrees(**given), "replan")
    assert plan.layout == layout and plan.splits == splits
    if splits > 1:
        assert f"{splits} accumulated micro-batches" in plan.report() and "world size" in plan.report()


def test_replan_refuses_devices_that_cannot_keep_the_global_batch() -> None:
    with pytest.raises(WorldSizeError, match=r"3 devices do not allow that\. Launch on one of \[1, 2, 4\]"):
        plan_for_world(3, degrees(dp=4), "replan")
    with pytest.raises(WorldSizeError, match=r"keeps pp x cp x tp = 2 .* Launch on one of \[2, 4\] devices"):
        plan_for_world(3, degrees(dp=2, tp=2), "replan")  # tp=2 does not divide 3
    with pytest.raises(WorldSizeError, match=r"ep=4 does not divide dp_shard x cp = 2 x 1"):
        plan_for_world(2, degrees(dp=4, ep=4), "replan")
    with pytest.raises(WorldSizeError, match="the world size"):
        plan_for_world(2, degrees(dp=4), "error")  # the default stops, as before


def test_the_option_is_checked_where_it_is_given() -> None:
    with pytest.raises(MeshConfigError, match=r"on_world_change='shrink' must be one of \('error', 'replan'\)"):
        MeshStrategy(on_world_change="shrink")  # type: ignore[arg-type]
    assert MeshStrategy(dp=4, on_world_change="replan").options.world.on_world_change == "replan"


def test_global_batches_split_into_micro_batches_in_row_order() -> None:
    def rows(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return indices, indices

    whole = GlobalBatches(40, rows, global_batch_size=8, dp_size=2, dp_rank=1, shuffle=True, seed=3)
    split = GlobalBatches(40, rows, global_batch_size=8, dp_size=2, dp_rank=1, shuffle=True, seed=3, splits=2)
    assert len(split) == 2 * len(whole) == 10
    halves = [batch for batch, _ in split]
    assert all(len(h) == 2 for h in halves)
    assert [torch.cat(halves[i : i + 2]).tolist() for i in range(0, 10, 2)] == [b.tolist() for b, _ in whole]
    resumed = GlobalBatches(
        40, rows, global_batch_size=8, dp_size=2, dp_rank=1, shuffle=True, seed=3, splits=2, start=lambda: (0, 3)
    )
    assert [b.tolist() for b, _ in resumed] == [h.tolist() for h in halves[6:]], "skips are counted in global batches"
    with pytest.raises(ValueError, match="data-parallel size 8"):
        GlobalBatches(40, rows, global_batch_size=4, dp_size=2, splits=4)


def _checkpoint(splits: int, processed: int) -> dict:
    counters = {"ready": processed, "started": processed, "processed": processed, "completed": processed}
    progress = {"total": dict(counters), "current": dict(counters), "is_last_batch": False}
    return {SPLITS_KEY: splits, "loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}


def test_loop_counters_are_rescaled_to_this_launchs_micro_batches() -> None:
    checkpoint = _checkpoint(1, 5)  # 5 steps on the planned layout
    rescale_batch_progress(checkpoint, 2)
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"] == progress["total"] == {"ready": 10, "started": 10, "processed": 10, "completed": 10}
    back = _checkpoint(2, 10)
    rescale_batch_progress(back, 1)  # and back onto the planned layout
    assert back["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 5
    without_key = _checkpoint(1, 5)
    del without_key[SPLITS_KEY]  # a checkpoint from before the option: one batch a step
    rescale_batch_progress(without_key, 4)
    assert without_key["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 20
    with pytest.raises(MeshConfigError, match="not saved at an optimizer step"):
        rescale_batch_progress(_checkpoint(2, 3), 1)


def test_replan_refuses_data_that_cannot_split_its_batches() -> None:
    trainer = SimpleNamespace(datamodule=None, accumulate_grad_batches=1)
    with pytest.raises(MeshConfigError, match="dataloaders passed to fit"):
        keep_global_batch(trainer, 2, 1)
    keep_global_batch(trainer, 1, 1)  # nothing to split: any data
    trainer.datamodule = SimpleNamespace(splits_global_batches=True)
    keep_global_batch(trainer, 2, 3)
    assert trainer.accumulate_grad_batches == 6


def test_the_logged_loss_of_an_accumulated_step_is_its_mean() -> None:
    accumulating = [True, True, False]  # three micro-batches, the optimizer steps after the third

    class Loop:
        def _should_accumulate(self) -> bool:
            return accumulating.pop(0)

    module = SimpleNamespace(_trainer=SimpleNamespace(training=True, fit_loop=SimpleNamespace(epoch_loop=Loop())))
    logged = [step_mean(module, "train_loss", torch.tensor(v)) for v in (1.0, 2.0, 6.0)]
    assert [t.item() for t in logged] == [1.0, 1.5, 3.0]
    alone = SimpleNamespace(_trainer=None)
    value = torch.tensor(0.1234567)
    assert step_mean(alone, "train_loss", value) is not None and step_mean(alone, "x", value).item() == value.item()
