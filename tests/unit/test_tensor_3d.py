"""3-D tensor parallel, pure logic (the 8-rank checks: tests/integration/test_tensor_3d.py): the closed-form bytes,
the weights' placements, and the refusals a 3-D linear gives before any collective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.tensor import Shard

from lit_mesh.errors import PlanError
from lit_mesh.parallel.tensor_3d import J, L, Linear3D, weight_placements
from lit_mesh.parallel.tensor_3d_bytes import bytes_3d


def test_bytes_3d_is_twice_each_block_over_a_q_rank_group() -> None:
    # q = 2: (q-1)/q^3 = 1/8 of (tokens in + in out + tokens out), twice, in fp32
    assert bytes_3d(24, 8, 12, tp=8) == 2 / 8 * (24 * 8 + 8 * 12 + 24 * 12) * 4
    # q = 4 and bf16: 2 * 3/64 of the same sum, 2 bytes each
    assert bytes_3d(4096, 1024, 4096, tp=64, element_size=2) == 2 * 3 / 64 * (4096 * 1024 + 1024 * 4096 + 4096 * 4096) * 2
    with pytest.raises(ValueError, match="tp=16 is not a cube"):
        bytes_3d(8, 8, 8, tp=16)


def test_the_dim_split_by_j_is_split_again_by_i() -> None:
    # mesh (tp_depth, tp_row, tp_col) = (j, i, l); W is (out, in)
    assert weight_placements(J) == (Shard(1), Shard(1), Shard(0))  # colwise: in by j then i, out by l
    assert weight_placements(L) == (Shard(0), Shard(0), Shard(1))  # rowwise: out by j then i, in by l


@pytest.mark.parametrize(
    "linear, style, message",
    [
        (nn.Linear(8, 8, bias=True), "colwise", r"wq has a bias, which tp_mode='3d' does not split; use bias=False"),
        (nn.Linear(8, 6, bias=False), "colwise", r"wq.out_features=6 divisible by q\^2=4"),
        (nn.Linear(8, 8, bias=False), "embedding", r"'colwise' \(layout A -> B\) or 'rowwise' \(B -> A\); wq has 'embedding'"),
    ],
)
def test_a_linear_the_grid_cannot_split_is_refused(linear: nn.Linear, style: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Linear3D(linear, SimpleNamespace(q=2), style, name="wq")  # type: ignore[arg-type]  # refused before the grid is used
