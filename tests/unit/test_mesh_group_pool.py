"""One communicator per set of members (lit_mesh.mesh.GroupPool), on torch's fake process group (one process, rank 0
of 8): the mesh's dims and views that span the same ranks share one group, and building the mesh asks torch for as
many groups as there are distinct sets of members. The timeouts on real gloo groups: tests/integration/test_mesh_groups.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from lit_mesh.mesh import MeshLayout, build_device_mesh


@pytest.fixture
def fake_world() -> Iterator[list[tuple[int, ...]]]:
    """Rank 0 of 8 on the fake backend; yields the members of every group torch was asked for."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    made: list[tuple[int, ...]] = []
    new_group = dist.new_group

    def recording(ranks: list[int] | None = None, **kwargs: object) -> object:
        made.append(tuple(ranks or ()))
        return new_group(ranks=ranks, **kwargs)

    dist.new_group = recording  # type: ignore[assignment]
    try:
        yield made
    finally:
        dist.new_group = new_group
        dist.destroy_process_group()


def test_views_over_the_same_ranks_share_one_group(fake_world: list[tuple[int, ...]]) -> None:
    views = build_device_mesh(MeshLayout(dp_shard=4, tp=2), "cpu")
    shard = [views.root.get_group("dp_shard"), views.dp.get_group(), views.dp_shard_cp.get_group()]
    shard += [views.dp_cp.get_group(), views.root["data_parallel"].get_group(), views.hsdp.get_group("dp_shard_cp")]
    shard += [views.expert_dp.get_group("efsdp")]
    assert all(group is shard[0] for group in shard), [g.group_name for g in shard]
    assert dist.get_process_group_ranks(shard[0]) == [0, 2, 4, 6]
    singletons = [views.root.get_group(n) for n in ("pp", "dp_replicate", "cp")] + [views.ep.get_group()]
    assert all(group is singletons[0] for group in singletons), [g.group_name for g in singletons]
    # torch was asked once per set of members: 8 singletons, 4 tp pairs, 2 dp_shard quadruples
    assert len(fake_world) == len(set(fake_world)) == 14, fake_world


def test_a_later_mesh_makes_its_own_groups(fake_world: list[tuple[int, ...]]) -> None:
    """The pool belongs to one mesh: a second mesh (a later fit, another layout) does not reuse the first's groups."""
    first = build_device_mesh(MeshLayout(dp_shard=4, tp=2), "cpu")
    second = build_device_mesh(MeshLayout(dp_shard=4, tp=2), "cpu")
    assert first.dp.get_group() is not second.dp.get_group()
