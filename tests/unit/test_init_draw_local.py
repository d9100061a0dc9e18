"""lit_mesh.init draws a sharded parameter's shard alone (only the blocks of DRAW_BLOCK elements it touches), with
the values the whole parameter has at those positions: on every rank of a 2 x 4 mesh (torch's fake process group,
one process), for parameters of one block and of several (uneven tail included) and several placements. A
parameter of one block keeps the values of a single generator seeded by (seed, name) over its whole shape."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lit_mesh import init as lit_init
from lit_mesh.init import DRAW_BLOCK, Init, draw_local, draw_whole, local_part, parameter_generator

PLACEMENTS = [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Shard(0))]


def test_one_block_keeps_the_single_generator_values() -> None:
    for init in (Init("normal", 0.02), Init("trunc_normal", 0.02), Init("ones")):
        for shape in ((64, 48), (5, 3), (DRAW_BLOCK // 512, 512)):
            single = init.sample(torch.Size(shape), parameter_generator(7, "layers.0.wq.weight"))
            assert torch.equal(draw_whole(init, torch.Size(shape), 7, "layers.0.wq.weight"), single), (init, shape)


@pytest.mark.parametrize("init", [Init("normal", 0.02), Init("trunc_normal", 0.02)])
def test_a_shard_draws_the_whole_parameters_values(monkeypatch: pytest.MonkeyPatch, init: Init) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setattr(lit_init, "DRAW_BLOCK", 64)  # many blocks on small tensors: the same code path, fast
    drawn: list[int] = []
    sample = Init.sample
    monkeypatch.setattr(Init, "sample", lambda self, shape, g: drawn.append(shape.numel()) or sample(self, shape, g))
    for shape in ((40, 12), (37, 9), (6, 5)):  # 480 = 7.5 blocks, 333 with a tail of 13, 30 < one block
        whole = draw_whole(init, torch.Size(shape), 3, "w")
        assert not torch.equal(whole[:5], draw_whole(init, torch.Size(shape), 4, "w")[:5])  # the seed matters
        for rank in range(8):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
            try:
                mesh = init_device_mesh("cpu", (2, 4))
                for placements in PLACEMENTS:
                    param = distribute_tensor(torch.empty(shape), mesh, placements, src_data_rank=None)
                    assert isinstance(param, DTensor)
                    drawn.clear()
                    got = draw_local(init, param, 3, "w")
                    assert got is not None and torch.equal(got, local_part(whole, param)), (rank, placements, shape)
                    # Shard(0) over 8 ranks: the rank's rows and at most the two blocks at their ends
                    if placements == (Shard(0), Shard(0)) and shape[0] * shape[1] > 64:
                        assert sum(drawn) <= got.numel() + 2 * 64, (drawn, got.shape)
            finally:
                dist.destroy_process_group()


def test_drawing_under_a_fake_tensor_mode_stays_in_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several blocks and several threads under FakeTensorMode (a planner's or a benchmark's probe): the mode is
    per thread, so the blocks are drawn where it is active, not in a pool that would hand it real tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    monkeypatch.setattr(lit_init, "DRAW_BLOCK", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with FakeTensorMode():
            drawn = draw_whole(Init("normal", 0.02), torch.Size((40, 12)), 3, "w")
    finally:
        torch.set_num_threads(threads)
    assert isinstance(drawn, FakeTensor) and drawn.shape == (40, 12)
