"""3-D tensor parallel on 8 gloo ranks (q = 2), against single-process references every rank computes whole
(run by tests/integration/test_tensor_3d.py).

Usage: torchrun --nproc_per_node=8 tests/workers/tp3d_checks.py OUT_DIR CHECK[,CHECK...]
Each check is its own pytest id (tests/worker_checks.py); rank r writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.parallel.tensor_3d import I, J, L, LAYOUT_A, LAYOUT_B, Linear3D, RMSNorm3D, piece
from lit_mesh.parallel.tensor_grid import TPGrid, build_grid
from lit_mesh.parallel.tensor_3d_bytes import bytes_3d
from tests.workers import exit_skipping_teardown
from tests.workers.checks import Checks, arguments

check = Checks()
BATCH, SEQ, IN, OUT = 8, 3, 8, 12  # batch split q^2 = 4 ways; features divisible by q^2
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, the project's parity tolerance
_GRID: list[TPGrid] = []


def grid() -> TPGrid:
    if not _GRID:
        _GRID.append(build_grid(init_device_mesh("cpu", (8,), mesh_dim_names=("tp",)), "3d", 2, 2))
    return _GRID[0]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))  # the same on every rank


def local_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The shard of `whole` a DTensor placed like `like` holds on this rank."""
    return distribute_tensor(whole, like.device_mesh, like.placements).to_local()


def linear_parity(style: str) -> None:
    g = grid()
    layout_in, layout_out = (LAYOUT_A, LAYOUT_B) if style == "colwise" else (LAYOUT_B, LAYOUT_A)
    reference = nn.Linear(IN, OUT, bias=False)
    reference.weight.data = randn(OUT, IN, seed=1)
    x = randn(BATCH, SEQ, IN, seed=2).requires_grad_()
    grad_y = randn(BATCH, SEQ, OUT, seed=3)
    y = reference(x)
    y.backward(grad_y)

    linear = Linear3D(reference, g, style)
    assert linear.weight.shape == (OUT, IN) and linear.weight.to_local().numel() == OUT * IN // 8
    x_piece = piece(x.detach(), g, layout_in).requires_grad_()
    with CollectiveBytes() as counter:
        y_piece = linear(x_piece)
        y_piece.backward(piece(grad_y, g, layout_out))
    torch.testing.assert_close(y_piece, piece(y.detach(), g, layout_out), **TOL)
    torch.testing.assert_close(x_piece.grad, piece(x.grad, g, layout_in), **TOL)
    torch.testing.assert_close(linear.weight.grad.to_local(), local_of(reference.weight.grad, linear.weight), **TOL)
    # the counter's ring model, group by group, equals the closed form
    names = {dim: g.group((dim,)).group_name for dim in (I, J, L)}
    assert set(counter.sent) == set(names.values()), (dict(counter.sent), names)
    assert sum(counter.sent.values()) == bytes_3d(BATCH * SEQ, IN, OUT, tp=8), (dict(counter.sent), bytes_3d(BATCH * SEQ, IN, OUT, 8))
    # the weight's group (i) moves its block twice: (q-1)/q of (in/q x out/q) fp32 each way
    assert counter.sent[names[I]] == 2 * (1 / 2) * (IN // 2) * (OUT // 2) * 4, dict(counter.sent)


@check
def colwise_linear_matches_nn_linear() -> None:
    """colwise (contracts over j): output, input gradient, weight gradient and bytes."""
    linear_parity("colwise")


@check
def rowwise_linear_matches_nn_linear() -> None:
    """rowwise (contracts over l): output, input gradient, weight gradient and bytes."""
    linear_parity("rowwise")


@check
def norm_and_feed_forward_keep_layout_a() -> None:
    """RMSNorm -> w1 (A -> B) -> silu -> w2 (B -> A), against nn modules: the layouts compose, the norm's weight
    gradient is summed over the ranks that share it, and clipping sees the global norm of DTensor gradients."""
    g = grid()
    norm, w1, w2 = nn.RMSNorm(IN, eps=1e-5), nn.Linear(IN, OUT, bias=False), nn.Linear(OUT, IN, bias=False)
    norm.weight.data = 1 + randn(IN, seed=4) / 4
    w1.weight.data, w2.weight.data = randn(OUT, IN, seed=5), randn(IN, OUT, seed=6)
    x = randn(BATCH, SEQ, IN, seed=7).requires_grad_()
    y = w2(F.silu(w1(norm(x))))
    y.backward(randn(*y.shape, seed=8))

    norm_3d = RMSNorm3D(norm, g)
    w1_3d, w2_3d = Linear3D(w1, g, "colwise"), Linear3D(w2, g, "rowwise")
    x_3d = piece(x.detach(), g, LAYOUT_A).requires_grad_()
    y_3d = w2_3d(F.silu(w1_3d(norm_3d(x_3d))))
    y_3d.backward(piece(randn(*y.shape, seed=8), g, LAYOUT_A))
    torch.testing.assert_close(y_3d, piece(y.detach(), g, LAYOUT_A), **TOL)
    torch.testing.assert_close(x_3d.grad, piece(x.grad, g, LAYOUT_A), **TOL)
    for module, module_3d in ((norm, norm_3d), (w1, w1_3d), (w2, w2_3d)):
        torch.testing.assert_close(module_3d.weight.grad.full_tensor(), module.weight.grad, **TOL)
    expected = nn.utils.clip_grad_norm_([norm.weight, w1.weight, w2.weight], 1.0)
    got = nn.utils.clip_grad_norm_([norm_3d.weight, w1_3d.weight, w2_3d.weight], 1.0)
    torch.testing.assert_close(got.full_tensor(), expected, **TOL)


if __name__ == "__main__":
    out_dir, selected = arguments()
    dist.init_process_group("gloo")
    check.run(selected)
    check.write(out_dir, dist.get_rank())
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()
    exit_skipping_teardown()
