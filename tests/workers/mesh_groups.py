"""Every process group lit-mesh makes carries the strategy's timeout, and ranks shared by several dims or views get
one communicator (run by tests/integration/test_mesh_groups.py on 4 gloo ranks).

Usage: python tests/workers/mesh_groups.py OUT_DIR CHECK[,CHECK...]   (rank r writes OUT_DIR/rank{r}.json)
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer

from lit_mesh import MeshStrategy, Topology
from lit_mesh.comm.hierarchical import build_hierarchy
from lit_mesh.mesh import MeshAxis, MeshLayout, MeshViews, build_device_mesh
from lit_mesh.parallel.grid.grid import build_grid
from tests.workers.checks import Checks, arguments

TIMEOUT = timedelta(seconds=42)  # the world's is torch's default (30 min): a group left at a default shows
check = Checks()


def timeout_of(group: dist.ProcessGroup) -> timedelta:
    """A gloo group's timeout (its backend's options)."""
    return group._get_backend(torch.device("cpu")).options._timeout


def view_groups(views: MeshViews) -> dict[str, dist.ProcessGroup]:
    """Every group of the run's mesh: its dims, the flattened views, Lightning's aliases, hsdp and the expert views."""
    groups = {name: views.root.get_group(name) for name in views.root.mesh_dim_names or ()}
    for name in ("dp", "dp_shard_cp", "dp_cp", "data_parallel", "tensor_parallel"):
        groups[name] = views[name].get_group()
    for view in ("hsdp", "expert_dp"):
        mesh = getattr(views, view)
        groups.update({f"{view}.{n}": mesh.get_group(n) for n in mesh.mesh_dim_names or ()})
    groups["ep"] = views.ep.get_group()
    return groups


def assert_timeouts(groups: dict[str, dist.ProcessGroup]) -> None:
    """Every group but the world's (a group of every rank is the world group, made by init_process_group with the
    strategy's timeout: here the worker made it with torch's default) carries TIMEOUT."""
    world = dist.distributed_c10d._get_default_group()
    wrong = {name: timeout_of(g) for name, g in groups.items() if g is not world and timeout_of(g) != TIMEOUT}
    assert not wrong, f"groups without the strategy's timeout {TIMEOUT}: {wrong}"


@check
def strategy_timeout_on_every_group() -> None:
    """MeshStrategy(timeout=...) on dp_shard 2 x tp 2: the mesh's groups, a hierarchy's node-local and cross-node
    groups, the async-save group and a 2-D TP grid's groups all carry it."""
    strategy = MeshStrategy(dp_shard=2, tp=2, timeout=TIMEOUT, async_save=True)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_progress_bar=False)
    assert trainer.strategy is strategy
    strategy.connect(LightningModule())  # what setup_environment hands the mesh to
    strategy.setup_environment()
    groups = view_groups(strategy._views)
    assert strategy.mesh_views is not None
    hierarchy = build_hierarchy(
        strategy.mesh_views.root,
        strategy.mesh_views.axes_of(MeshAxis.DP_CP),
        strategy.mesh_views.dp_cp.get_group(),
        Topology(nodes=2, devices_per_node=2),
        "hierarchical",
        "dp_cp",
        skip_trivial=False,
    )
    assert hierarchy is not None
    groups.update({"hierarchy.intra": hierarchy.intra, "hierarchy.inter": hierarchy.inter})
    saver_group = strategy._checkpoints._saver._group
    assert saver_group is not None
    groups["async_save"] = saver_group
    assert_timeouts(groups)


@check
def tp_grid_groups() -> None:
    """A 2-D TP grid (tp 4 as 2 x 2) made after the mesh: its row and column groups carry the timeout (their
    flattened row x col group is every rank: the world's)."""
    views = build_device_mesh(MeshLayout(tp=4), "cpu", TIMEOUT)
    grid = build_grid(views.root, "2d", 1, 2)
    groups = {f"grid.{n}": grid.mesh.get_group(n) for n in grid.mesh.mesh_dim_names or ()}
    groups["grid.row_col"] = grid.group(("tp_row", "tp_col"))
    assert_timeouts({k: g for k, g in groups.items() if g is not None})


@check
def shared_members_one_communicator() -> None:
    """dp_shard 2 x tp 2: dp_shard, dp, dp_shard_cp, dp_cp, data_parallel, hsdp's shard dim and the expert shard
    dim are the same two ranks; they are one group. The size-1 dims share this rank's one singleton group."""
    views = build_device_mesh(MeshLayout(dp_shard=2, tp=2), "cpu", TIMEOUT)
    groups = view_groups(views)
    shard = ["dp_shard", "dp", "dp_shard_cp", "dp_cp", "data_parallel", "hsdp.dp_shard_cp", "expert_dp.efsdp"]
    assert len({id(groups[name]) for name in shard}) == 1, {name: groups[name].group_name for name in shard}
    assert dist.get_process_group_ranks(groups["dp"]) == [dist.get_rank() % 2, dist.get_rank() % 2 + 2]
    singletons = ["pp", "dp_replicate", "cp", "hsdp.dp_replicate", "expert_dp.edp_replicate", "ep"]
    assert len({id(groups[name]) for name in singletons}) == 1, {name: groups[name].group_name for name in singletons}
    assert len({id(g) for g in groups.values()}) == 3, {name: g.group_name for name, g in groups.items()}
    # the shared group works as each view's: a sum over dp reaches the two members
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=views.dp_cp.get_group())
    assert value.item() == 2 * (dist.get_rank() % 2) + 2, value


if __name__ == "__main__":
    out_dir, selected = arguments()
    check.run_on_gloo(out_dir, selected)
