"""The 2-D (SUMMA) and 2.5-D (Tesseract) linear layer on the tp grid (lit_mesh/parallel/grid/grid.py).

Rank (h, i, j) of the (depth, q, q) grid holds
  - activations X[h, i][j]: the batch block h * q + i (of depth * q), feature block j (of q);
  - weight W[i][j] of W = linear.weight^T (in, out): in-block i, out-block j; the same block on every depth h.
As the nn.Linear parameter (out, in) that is placements [Replicate(), Shard(1), Shard(0)] on (depth, row, col).

Forward, Y[i][j] = sum_k X[i][k] W[k][j], in q steps: X[i][k] is broadcast along row i (from column k), W[k][j]
along column j (from row k). Backward, in q steps too (SUMMA for A B^T and A^T B):
  dX[i][k] = sum_j dY[i][j] W[k][j]^T: W[k][j] broadcast along column j, the products reduced along row i to (i, k);
  dW[k][j] = sum_i X[i][k]^T dY[i][j]: X[i][k] broadcast along row i, the products reduced along column j to (k, j);
  2.5-D: each depth holds other samples, so dW is then summed over depth (an all-reduce of the block).
Broadcast and reduce, not all-gather: each step needs one block, held once (the memory SUMMA exists to save).
The forward's broadcast X blocks are not kept: backward broadcasts them again (memory over bytes, as SUMMA does).
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lit_mesh.parallel.grid.grid import ActivationLayout, TPGrid, grid_parameter

LAYOUT = ActivationLayout(batch=("tp_depth", "tp_row"), features=("tp_col",))
WEIGHT_PLACEMENTS = (Replicate(), Shard(1), Shard(0))  # (out, in) on (depth, row, col)
BIAS_PLACEMENTS = (Replicate(), Replicate(), Shard(0))


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, grid: TPGrid) -> Tensor:
        """x (N, in/q): this rank's block; w (out/q, in/q): its weight block (nn.Linear's orientation)."""
        row, col = grid.mesh.get_group("tp_col"), grid.mesh.get_group("tp_row")  # ranks along a row / a column
        i, j = grid.coordinate("tp_row"), grid.coordinate("tp_col")
        y = x.new_zeros(x.shape[0], w.shape[0])
        for k in range(grid.q):
            xk = x.contiguous() if j == k else x.new_empty(x.shape)
            wk = w.contiguous() if i == k else w.new_empty(w.shape)
            dist.broadcast(xk, group=row, group_src=k)
            dist.broadcast(wk, group=col, group_src=k)
            y.addmm_(xk, wk.t())
        ctx.save_for_backward(x, w)
        ctx.grid = grid
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Optional[Tensor], Optional[Tensor], None]:
        x, w = ctx.saved_tensors
        grid: TPGrid = ctx.grid
        row, col = grid.mesh.get_group("tp_col"), grid.mesh.get_group("tp_row")
        i, j = grid.coordinate("tp_row"), grid.coordinate("tp_col")
        dy = dy.contiguous()
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        for k in range(grid.q):
            wk = w.contiguous() if i == k else w.new_empty(w.shape)
            xk = x.contiguous() if j == k else x.new_empty(x.shape)
            dist.broadcast(wk, group=col, group_src=k)
            dist.broadcast(xk, group=row, group_src=k)
            part_x = dy @ wk  # dY[i][j] W[k][j]^T, for (i, k)
            part_w = dy.t() @ xk  # (X[i][k]^T dY[i][j])^T, for (k, j)
            dist.reduce(part_x, group=row, group_dst=k)
            dist.reduce(part_w, group=col, group_dst=k)
            if j == k:
                dx.copy_(part_x)
            if i == k:
                dw.copy_(part_w)
        if grid.depth > 1:  # the other depths computed the same block from their samples
            dist.all_reduce(dw, group=grid.mesh.get_group("tp_depth"))
        return dx, dw, None


class SumGradOver(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group`: a parameter block replicated on ranks that
    each saw other samples (norm weights, embedding, bias)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.group is not None:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def summa_matmul(x: Tensor, w: Tensor, grid: TPGrid) -> Tensor:
    """x (..., in/q) @ w (out/q, in/q)^T on the grid -> (..., out/q): Y = X W^T blockwise."""
    y = _Summa.apply(x.reshape(-1, x.shape[-1]), w, grid)
    return y.view(*x.shape[:-1], w.shape[0])


class SummaLinear(nn.Module):
    """nn.Linear on the 2-D / 2.5-D grid: `weight` (and `bias`) keep their names and full shapes, as DTensors."""

    def __init__(self, linear: nn.Linear, grid: TPGrid, batch_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.grid, self.batch_group = grid, batch_group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = grid_parameter(linear.weight, grid, WEIGHT_PLACEMENTS)
        if linear.bias is not None:
            self.bias = grid_parameter(linear.bias, grid, BIAS_PLACEMENTS)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        w = cast(DTensor, self.weight).to_local()  # grid_parameter's Parameter wraps a DTensor
        if torch.is_autocast_enabled(x.device.type):  # as nn.Linear under autocast: the matmul in its dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        y = summa_matmul(x, w, self.grid)
        if self.bias is not None:
            y = y + SumGradOver.apply(cast(DTensor, self.bias).to_local(), self.batch_group)
        return y

    def extra_repr(self) -> str:
        g = self.grid
        return f"in={self.in_features}, out={self.out_features}, grid=(depth {g.depth}, {g.q} x {g.q})"


class SummaScheme:
    """2-D (depth 1) and 2.5-D: one scheme, the grid's depth tells them apart (GridScheme in grid.py)."""

    name = "summa"

    def layout(self, grid: TPGrid) -> ActivationLayout:
        return LAYOUT

    def linear(self, module: nn.Linear, grid: TPGrid, style: str) -> nn.Module:
        return SummaLinear(module, grid, grid.group(LAYOUT.batch))
