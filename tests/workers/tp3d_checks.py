"""3-D tensor parallel on 8 gloo ranks (q = 2), against single-process references every rank computes whole
(run by tests/integration/test_tensor_3d.py).

Usage: torchrun --nproc_per_node=8 tests/workers/tp3d_checks.py OUT_DIR CHECK[,CHECK...]
Each check is its own pytest id (tests/worker_checks.py); rank r writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.parallel.tensor_3d import Grid3D, Linear3D, RMSNorm3D, from_layout_a, piece, to_layout_a
from lit_mesh.parallel.tensor_3d_bytes import bytes_3d
from tests.workers import exit_skipping_teardown
from tests.workers.checks import Checks, arguments

check = Checks()
BATCH, SEQ, IN, OUT = 8, 3, 8, 12  # batch split q^2 = 4 ways; features divisible by q^2
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, the project's parity tolerance
_GRID: list[Grid3D] = []


def grid() -> Grid3D:
    if not _GRID:
        _GRID.append(Grid3D.from_tp_mesh(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))))
    return _GRID[0]


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))  # the same on every rank


def local_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The shard of `whole` a DTensor placed like `like` holds on this rank."""
    return distribute_tensor(whole, like.device_mesh, like.placements).to_local()


def linear_parity(contract: str) -> None:
    g = grid()
    layout_in, layout_out = ("A", "B") if contract == "j" else ("B", "A")
    reference = nn.Linear(IN, OUT, bias=False)
    reference.weight.data = randn(OUT, IN, seed=1)
    x = randn(BATCH, SEQ, IN, seed=2).requires_grad_()
    grad_y = randn(BATCH, SEQ, OUT, seed=3)
    y = reference(x)
    y.backward(grad_y)

    linear = Linear3D.from_linear(copy.deepcopy(reference), g, contract)
    assert linear.weight.shape == (OUT, IN) and linear.weight.to_local().numel() == OUT * IN // 8
    x_piece = piece(x.detach(), g, layout_in).requires_grad_()
    with CollectiveBytes() as counter:
        y_piece = linear(x_piece)
        y_piece.backward(piece(grad_y, g, layout_out))
    torch.testing.assert_close(y_piece, piece(y.detach(), g, layout_out), **TOL)
    torch.testing.assert_close(x_piece.grad, piece(x.grad, g, layout_in), **TOL)
    torch.testing.assert_close(linear.weight.grad.to_local(), local_of(reference.weight.grad, linear.weight), **TOL)
    # the counter's ring model, group by group, equals the closed form
    names = {dim: g.group(dim).group_name for dim in "ijl"}
    assert set(counter.sent) == set(names.values()), (dict(counter.sent), names)
    assert sum(counter.sent.values()) == bytes_3d(BATCH * SEQ, IN, OUT, tp=8), (dict(counter.sent), bytes_3d(BATCH * SEQ, IN, OUT, 8))
    # the weight's group (i) moves its block twice: (q-1)/q of (in/q x out/q) fp32 each way
    assert counter.sent[names["i"]] == 2 * (1 / 2) * (IN // 2) * (OUT // 2) * 4, dict(counter.sent)


@check
def linear_a_to_b_matches_nn_linear() -> None:
    """contract over j: output, input gradient, weight gradient and bytes."""
    linear_parity("j")


@check
def linear_b_to_a_matches_nn_linear() -> None:
    """contract over l: output, input gradient, weight gradient and bytes."""
    linear_parity("l")


@check
def norm_and_feed_forward_keep_layout_a() -> None:
    """RMSNorm -> w1 (A -> B) -> silu -> w2 (B -> A) from a whole input and back to it, against nn modules:
    the layouts compose, the norm's weight gradient is summed over the ranks that share it, and clipping
    sees the global norm of DTensor gradients."""
    g = grid()
    norm, w1, w2 = nn.RMSNorm(IN, eps=1e-5), nn.Linear(IN, OUT, bias=False), nn.Linear(OUT, IN, bias=False)
    norm.weight.data = 1 + randn(IN, seed=4) / 4
    w1.weight.data, w2.weight.data = randn(OUT, IN, seed=5), randn(IN, OUT, seed=6)
    x = randn(BATCH, SEQ, IN, seed=7).requires_grad_()
    y = w2(F.silu(w1(norm(x))))
    y.backward(randn(*y.shape, seed=8))

    norm_3d = RMSNorm3D.from_norm(copy.deepcopy(norm), g)
    w1_3d, w2_3d = Linear3D.from_linear(copy.deepcopy(w1), g, "j"), Linear3D.from_linear(copy.deepcopy(w2), g, "l")
    x_3d = x.detach().clone().requires_grad_()
    y_3d = from_layout_a(w2_3d(F.silu(w1_3d(norm_3d(to_layout_a(x_3d, g))))), g)
    y_3d.backward(randn(*y.shape, seed=8))
    torch.testing.assert_close(y_3d, y.detach(), **TOL)
    torch.testing.assert_close(x_3d.grad, x.grad, **TOL)
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
