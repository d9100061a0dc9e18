"""3-D tensor parallel (tp_mode="3d", q = 2) on 8 gloo ranks: the checks tests/workers/tp_grid.py runs for it in its
launch, against single-process references every rank computes whole. Each takes the 2 x 2 x 2 grid."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.parallel.tensor_3d import I, J, L, LAYOUT_A, LAYOUT_B, Linear3D
from lit_mesh.parallel.tensor_grid import ActivationLayout, TPGrid, local_block
from lit_mesh.parallel.tensor_nd import GridRMSNorm
from lit_mesh.parallel.tensor_nd_bytes import linear_bytes_3d
from tests.workers.checks import assert_close_reduction

BATCH, SEQ, N_IN, N_OUT = 8, 3, 8, 12  # batch split q^2 = 4 ways; features divisible by q^2
TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, the project's parity tolerance


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))  # the same on every rank


def piece(whole: torch.Tensor, grid: TPGrid, layout: ActivationLayout) -> torch.Tensor:
    """This rank's block of a whole (batch, ..., features) tensor in `layout`."""
    return local_block(local_block(whole, grid, 0, layout.batch), grid, -1, layout.features).contiguous()


def local_of(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The shard of `whole` a DTensor placed like `like` holds on this rank."""
    return distribute_tensor(whole, like.device_mesh, like.placements).to_local()


def linear_matches_nn_linear(grid: TPGrid, style: str) -> None:
    """Output, input gradient and weight gradient against nn.Linear; the byte counter, group by group, against
    linear_bytes_3d."""
    layout_in, layout_out = (LAYOUT_A, LAYOUT_B) if style == "colwise" else (LAYOUT_B, LAYOUT_A)
    reference = nn.Linear(N_IN, N_OUT, bias=False)
    reference.weight.data = randn(N_OUT, N_IN, seed=1)
    x = randn(BATCH, SEQ, N_IN, seed=2).requires_grad_()
    grad_y = randn(BATCH, SEQ, N_OUT, seed=3)
    y = reference(x)
    y.backward(grad_y)

    linear = Linear3D(reference, grid, style)
    assert linear.weight.shape == (N_OUT, N_IN) and linear.weight.to_local().numel() == N_OUT * N_IN // 8
    x_piece = piece(x.detach(), grid, layout_in).requires_grad_()
    with CollectiveBytes() as counter:
        y_piece = linear(x_piece)
        y_piece.backward(piece(grad_y, grid, layout_out))
    # sums in other orders than nn.Linear's: over the inputs (y), the outputs (x.grad), the rows (weight gradient)
    assert_close_reduction(y_piece, piece(y.detach(), grid, layout_out), terms=N_IN)
    assert_close_reduction(x_piece.grad, piece(x.grad, grid, layout_in), terms=N_OUT)
    assert_close_reduction(linear.weight.grad.to_local(), local_of(reference.weight.grad, linear.weight), terms=BATCH * SEQ)
    names = {dim: grid.group((dim,)).group_name for dim in (I, J, L)}
    assert set(counter.sent) == set(names.values()), (dict(counter.sent), names)
    want = linear_bytes_3d(BATCH * SEQ, N_IN, N_OUT, q=2, element_bytes=4)
    assert sum(counter.sent.values()) == want, (dict(counter.sent), want)
    # the weight's group (i) moves its block twice: (q-1)/q of (in/q x out/q) fp32 each way
    assert counter.sent[names[I]] == 2 * (1 / 2) * (N_IN // 2) * (N_OUT // 2) * 4, dict(counter.sent)
    # under bf16 autocast, as nn.Linear: bf16 output, fp32 weight gradient
    reference.weight.grad, linear.weight.grad = None, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = reference(x.detach())
        y_piece = linear(piece(x.detach(), grid, layout_in))
    y.float().backward(grad_y)
    y_piece.float().backward(piece(grad_y, grid, layout_out))
    assert y_piece.dtype == torch.bfloat16 and linear.weight.grad.dtype == torch.float32
    torch.testing.assert_close(y_piece, piece(y.detach(), grid, layout_out), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(linear.weight.grad.to_local(), local_of(reference.weight.grad, linear.weight), rtol=2e-2, atol=5e-2)


def norm_and_feed_forward_keep_layout_a(grid: TPGrid) -> None:
    """RMSNorm -> w1 (A -> B) -> silu -> w2 (B -> A), against nn modules: the layouts compose, the norm's weight
    gradient is summed over the ranks that share it, and clipping sees the global norm of DTensor gradients."""
    norm, w1, w2 = nn.RMSNorm(N_IN, eps=1e-5), nn.Linear(N_IN, N_OUT, bias=False), nn.Linear(N_OUT, N_IN, bias=False)
    norm.weight.data = 1 + randn(N_IN, seed=4) / 4
    w1.weight.data, w2.weight.data = randn(N_OUT, N_IN, seed=5), randn(N_IN, N_OUT, seed=6)
    x = randn(BATCH, SEQ, N_IN, seed=7).requires_grad_()
    y = w2(F.silu(w1(norm(x))))
    y.backward(randn(*y.shape, seed=8))

    norm_3d = GridRMSNorm(norm, grid, LAYOUT_A)
    w1_3d, w2_3d = Linear3D(w1, grid, "colwise"), Linear3D(w2, grid, "rowwise")
    x_3d = piece(x.detach(), grid, LAYOUT_A).requires_grad_()
    y_3d = w2_3d(F.silu(w1_3d(norm_3d(x_3d))))
    y_3d.backward(piece(randn(*y.shape, seed=8), grid, LAYOUT_A))
    torch.testing.assert_close(y_3d, piece(y.detach(), grid, LAYOUT_A), **TOL)
    torch.testing.assert_close(x_3d.grad, piece(x.grad, grid, LAYOUT_A), **TOL)
    for module, module_3d in ((norm, norm_3d), (w1, w1_3d), (w2, w2_3d)):
        torch.testing.assert_close(module_3d.weight.grad.full_tensor(), module.weight.grad, **TOL)
    expected = nn.utils.clip_grad_norm_([norm.weight, w1.weight, w2.weight], 1.0)
    got = nn.utils.clip_grad_norm_([norm_3d.weight, w1_3d.weight, w2_3d.weight], 1.0)
    torch.testing.assert_close(got.full_tensor(), expected, **TOL)


def checkpoint_loads_into_one_device(model: nn.Module, reference: nn.Module, path: Path) -> None:
    """The 3-D model's weights (nested Shard placements: the dim split by j is split again by i), saved with DCP,
    load into the single-device model's state dict as the whole tensors."""
    assert isinstance(model.layers[0].attention.wq, Linear3D)
    dcp.save(model.state_dict(), checkpoint_id=path)
    loaded = {name: torch.zeros_like(p) for name, p in reference.state_dict().items()}
    dcp.load(loaded, checkpoint_id=path)
    for name, p in model.state_dict().items():
        torch.testing.assert_close(loaded[name], p.full_tensor(), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(loaded[name], reference.state_dict()[name], rtol=0, atol=0, msg=name)
