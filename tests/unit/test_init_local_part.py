"""lit_mesh.init.local_part slices a rank's part of a whole tensor where it lies (no copy of the whole tensor to the
device first): on every rank of a 2 x 4 mesh (torch's fake process group, one process), for even and uneven
shapes and several placements, it equals what distribute_tensor gives that rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lit_mesh.init import local_part

PLACEMENTS = [
    (Shard(0), Replicate()),
    (Replicate(), Shard(0)),
    (Shard(0), Shard(1)),
    (Shard(1), Shard(0)),
    (Shard(0), Shard(0)),
    (Replicate(), Replicate()),
]


@pytest.mark.parametrize("shape", [(8, 12), (10, 7), (3, 5)])
def test_local_part_is_the_ranks_shard(shape: tuple[int, int]) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for rank in range(8):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        try:
            mesh = init_device_mesh("cpu", (2, 4))
            for placements in PLACEMENTS:
                expected = distribute_tensor(full, mesh, placements, src_data_rank=None)
                got = local_part(full, expected)
                assert torch.equal(got, expected.to_local()), (rank, placements, got.shape)
        finally:
            dist.destroy_process_group()
