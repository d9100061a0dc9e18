"""3-D tensor parallel, pure logic (the 8-rank checks: tests/integration/test_tensor_3d.py): the closed-form bytes,
the weights' placements, and the refusals a 3-D linear gives before any collective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn
from torch.distributed.tensor import Shard

from lit_mesh import MeshStrategy
from lit_mesh.errors import MeshConfigError, PlanError
from lit_mesh.parallel.grid.bytes import BlockShape, bytes_3d, linear_bytes_3d, norm_bytes_3d
from lit_mesh.parallel.grid.cube import J, L, Linear3D, ThreeDScheme, weight_placements
from lit_mesh.parallel.grid.schemes import SCHEMES


def test_3d_bytes_are_twice_each_block_over_a_q_rank_group() -> None:
    # q = 2: (q-1)/q^3 = 1/8 of (tokens in + in out + tokens out), twice, in fp32
    assert linear_bytes_3d(24, 8, 12, q=2, element_bytes=4) == 2 / 8 * (24 * 8 + 8 * 12 + 24 * 12) * 4
    # q = 4 and bf16: 2 * 3/64 of the same sum, 2 bytes each
    big = 2 * 3 / 64 * (4096 * 1024 + 1024 * 4096 + 4096 * 4096) * 2
    assert linear_bytes_3d(4096, 1024, 4096, q=4, element_bytes=2) == big
    block = BlockShape(tokens=64, dim=32, heads=4, kv_heads=2, ffn=64)
    linears = [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)]
    assert bytes_3d(block, 8) == sum(linear_bytes_3d(64, i, o, 2, 4) for i, o in linears) + 2 * norm_bytes_3d(block, 2)
    with pytest.raises(AssertionError, match="3-D needs p = q \\* q \\* q, not 16"):
        bytes_3d(block, 16)


def test_tp_mode_3d_is_a_scheme_on_cubes() -> None:
    assert isinstance(SCHEMES["3d"], ThreeDScheme)
    MeshStrategy(tp=8, tp_mode="3d")
    with pytest.raises(
        MeshConfigError, match=r"tp_mode='3d' needs tp = q \* q \* q .* but tp=4; use tp in \[8, 27, 64\]"
    ):
        MeshStrategy(tp=4, tp_mode="3d")


def test_the_dim_split_by_j_is_split_again_by_i() -> None:
    # mesh (tp_depth, tp_row, tp_col) = (j, i, l); W is (out, in)
    assert weight_placements(J) == (Shard(1), Shard(1), Shard(0))  # colwise: in by j then i, out by l
    assert weight_placements(L) == (Shard(0), Shard(0), Shard(1))  # rowwise: out by j then i, in by l


@pytest.mark.parametrize(
    "linear, style, message",
    [
        (nn.Linear(8, 8, bias=True), "colwise", r"wq has a bias, which tp_mode='3d' does not split; use bias=False"),
        (nn.Linear(8, 6, bias=False), "colwise", r"wq.out_features=6 divisible by q\^2=4"),
        (
            nn.Linear(8, 8, bias=False),
            "embedding",
            r"'colwise' \(layout A -> B\) or 'rowwise' \(B -> A\); wq has 'embedding'",
        ),
    ],
)
def test_a_linear_the_grid_cannot_split_is_refused(linear: nn.Linear, style: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Linear3D(linear, SimpleNamespace(q=2), style, name="wq")  # type: ignore[arg-type]  # refused before the grid is used
