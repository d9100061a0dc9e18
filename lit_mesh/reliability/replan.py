"""Continue on fewer devices: `MeshStrategy(on_world_change="replan")`.

A relaunch with fewer devices than the planned layout (a node lost, a smaller allocation) keeps pp, cp, tp and ep
and shrinks data parallelism to what is left. The planned global batch is kept with the same rows per rank: each
global batch is served as `splits` micro-batches (the data-parallel ranks lost, as a factor) and Lightning
accumulates them into one optimizer step, so the run continues the planned loss curve. The checkpoint's sharded
weights and optimizer state are resharded by DCP; the loop counters, which Lightning keeps in micro-batches, are
rescaled from the splits they were saved with (`rescale_batch_progress`).

Only data modules that serve layout-independent global batches can split them (zoo.GlobalBatchDataModule and its
subclasses declare `splits_global_batches = True`); any other data is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from lit_mesh.errors import MeshConfigError, WorldSizeError
from lit_mesh.mesh import MeshLayout, resolve_layout
from lit_mesh.unit import divisors, option

OnWorldChange = Literal["error", "replan"]
ON_WORLD_CHANGE = ("error", "replan")
SPLITS_KEY = "lit_mesh_global_batch_splits"  # in every checkpoint: the splits its loop counters count in


def check_on_world_change(value: str) -> None:
    if value not in ON_WORLD_CHANGE:
        raise MeshConfigError(
            f"on_world_change={value!r} must be one of {ON_WORLD_CHANGE}: 'error' stops when the devices do not fill"
            " the layout, 'replan' shrinks data parallelism to them and keeps the global batch by accumulation"
        )


@dataclass(frozen=True)
class WorldChangeOptions:
    on_world_change: OnWorldChange = option(
        "error",
        doc='a launch on fewer devices than the degrees plan: "error" (default), or "replan": keep pp, cp, tp and ep,'
        " shrink data parallelism to the devices there are, and keep the planned global batch and rows per rank by"
        " accumulating micro-batches, so a resumed run continues its loss curve (data from"
        " zoo.GlobalBatchDataModule). See lit_mesh/reliability/replan.py.",
    )

    def __post_init__(self) -> None:
        check_on_world_change(self.on_world_change)


def planned_data_parallel(degrees: dict[str, Any]) -> Optional[int]:
    """The data-parallel degree the user planned, or None where it fills the world ('auto', or not given)."""
    dp, replicate, shard = degrees.get("dp"), degrees.get("dp_replicate"), degrees.get("dp_shard")
    if isinstance(dp, int):
        return dp
    if isinstance(shard, int):
        return shard * (replicate or 1)
    return None


@dataclass(frozen=True)
class WorldPlan:
    """The layout this launch runs, and how many micro-batches each planned global batch is served as."""

    layout: MeshLayout
    splits: int = 1
    planned: Optional[str] = None  # the planned layout, when a replan changed it

    def report(self) -> str:
        return (
            f"on_world_change='replan': the planned layout {self.planned} does not fit {self.layout.world_size}"
            f" devices; running {self.layout.describe()}, each global batch as {self.splits} accumulated"
            " micro-batches (the same rows per rank and the same global batch as planned)"
        )


def plan_for_world(world_size: int, degrees: dict[str, Any], on_world_change: OnWorldChange) -> WorldPlan:
    """resolve_layout, or with on_world_change='replan' and too few devices for the planned degrees, the planned
    layout with data parallelism shrunk to the devices there are."""
    planned_dp = planned_data_parallel(degrees)
    if on_world_change == "error" or planned_dp is None:
        return WorldPlan(resolve_layout(world_size, **degrees))
    model_parallel = degrees["pp"] * degrees["cp"] * degrees["tp"]
    if world_size == planned_dp * model_parallel:
        return WorldPlan(resolve_layout(world_size, **degrees))
    planned = resolve_layout(planned_dp * model_parallel, **degrees)
    fitting = [n * model_parallel for n in divisors(planned_dp)]
    if world_size % model_parallel or planned_dp % (world_size // model_parallel):
        raise WorldSizeError(
            f"on_world_change='replan' keeps pp x cp x tp = {model_parallel} and shrinks the planned data-parallel"
            f" degree {planned_dp} to a divisor of it (so the global batch is kept by accumulation); {world_size}"
            f" devices do not allow that. Launch on one of {fitting} devices"
        )
    dp = world_size // model_parallel
    # keep the planned shard degree where it still fits (HSDP loses replicas first), else shard over what is left
    shard = planned.dp_shard if dp % planned.dp_shard == 0 else dp
    layout = MeshLayout(
        pp=planned.pp, dp_replicate=dp // shard, dp_shard=shard, cp=planned.cp, tp=planned.tp, ep=planned.ep
    )
    if (layout.dp_shard * layout.cp) % layout.ep:
        raise WorldSizeError(
            f"on_world_change='replan': ep={layout.ep} does not divide dp_shard x cp = {layout.dp_shard} x"
            f" {layout.cp} on {world_size} devices (expert parallel borrows those ranks); launch on more of"
            f" {fitting} devices, or plan a smaller ep"
        )
    return WorldPlan(layout, splits=planned_dp // dp, planned=planned.describe())


def keep_global_batch(trainer: Any, splits: int, base_accumulation: int) -> None:
    """Accumulate `splits` micro-batches per planned global batch, from data that serves them split."""
    if splits == 1:
        return
    data = trainer.datamodule
    if not getattr(data, "splits_global_batches", False):
        raise MeshConfigError(
            f"on_world_change='replan' serves each global batch as {splits} micro-batches, which needs a data"
            f" module of layout-independent global batches (zoo.GlobalBatchDataModule, e.g. zoo.TokenDataModule);"
            f" {type(data).__name__ if data is not None else 'dataloaders passed to fit()'} cannot split them."
            " Use such a data module, or on_world_change='error' with degrees for these devices"
        )
    trainer.accumulate_grad_batches = base_accumulation * splits


def rescale_batch_progress(checkpoint: dict[str, Any], splits: int) -> None:
    """Lightning's batch counters of a checkpoint saved with other splits -> this launch's micro-batches (so that
    accumulation stays aligned with global batches and the epoch ends where it should)."""
    saved = int(checkpoint.get(SPLITS_KEY, 1))
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if saved == splits or progress is None:
        return
    for counters in (progress["total"], progress["current"]):
        for name, count in counters.items():
            if count % saved:
                raise MeshConfigError(
                    f"the checkpoint's {name} batch count {count} is not a whole number of global batches of"
                    f" {saved} micro-batches: it was not saved at an optimizer step; resume from one that was"
                )
            counters[name] = count // saved * splits
