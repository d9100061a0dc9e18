"""3-D tensor parallel (Agarwal et al. 1995; Colossal-AI's 3-D TP) on the q x q x q grid (grid.py, tp_mode "3d").

Rank (i, j, l) multiplies block A_ij of the input by block B_jl of the weight; the q ranks along j sum their
products into C_il. Every block is held split a further 1/q by the grid dim that does not index it, so nothing
is stored twice. The grid dims play j = "tp_depth", i = "tp_row", l = "tp_col".
- activations (batch, ..., features): the batch split q^2 ways, i-major, the features q ways. In LAYOUT_A the
  features go by j and the batch's second split by l; in LAYOUT_B the two swap. A "colwise" linear (contracting
  over j) takes A to B: all-gather the batch over l and the weight over i, multiply, reduce-scatter the product
  over j. A "rowwise" linear (contracting over l) takes B back to A. The residual stream stays in LAYOUT_A, and
  between a colwise and a rowwise linear (attention, the MLP's activation) the features go by l: q head groups.
- weights W (out, in): the in dim goes by the contracted dim, the out dim by the other of j and l, and the
  dim that goes by j is split again by i. On the mesh (depth, row, col) = (j, i, l) that is DTensor's
  left-to-right nested Shard, so a weight is an ordinary DTensor of the full shape.
Backward mirrors forward: each all-gather becomes a reduce-scatter over the same dim and back. The gathered
input and weight blocks are kept for backward, so nothing is gathered twice.
Norms, the embedding and the head are the grid's own (apply.py) in LAYOUT_A: the RMSNorm's sum of squares
all-reduced over j, its weight's gradient summed over (i, l).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed import _functional_collectives as funcol
from torch.distributed.tensor import DTensor, Placement, Shard

from lit_mesh.errors import PlanError
from lit_mesh.parallel.grid.grid import ActivationLayout, TPGrid, grid_parameter

J, I, L = "tp_depth", "tp_row", "tp_col"
LAYOUT_A = ActivationLayout(batch=(I, L), features=(J,))  # between blocks
LAYOUT_B = ActivationLayout(batch=(I, J), features=(L,))  # inside attention and the MLP
_CONTRACT = {"colwise": J, "rowwise": L}  # the plan's TP style -> the grid dim the matmul sums over
_OTHER = {J: L, L: J}


def weight_placements(contract: str) -> tuple[Placement, ...]:
    """W (out, in) on (depth, row, col) = (j, i, l): in by `contract`, out by the other, the j dim split again by i."""
    j_dim = 1 if contract == J else 0
    return Shard(j_dim), Shard(j_dim), Shard(1 - j_dim)


def _group(grid: TPGrid, name: str) -> ProcessGroup:
    group = grid.group((name,))
    assert group is not None, "a 3-D grid has q >= 2 on every dim"
    return group


def _gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), dim, group))


def _scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


class _Matmul3D(torch.autograd.Function):
    """y = x w^T on the grid: x's batch gathered over the other dim, w over i, the product reduce-scattered over
    `contract`; backward: dy gathered over `contract`, dx reduce-scattered over the other dim, dw over i."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, grid: TPGrid, contract: str) -> torch.Tensor:
        w_dim = 1 if contract == J else 0
        x_block = _gather(x, 0, _group(grid, _OTHER[contract]))  # A_ij (in layout B: its mirror)
        w_block = _gather(w, w_dim, _group(grid, I))  # B_jl
        ctx.save_for_backward(x_block, w_block)
        ctx.grid, ctx.contract, ctx.w_dim = grid, contract, w_dim
        return _scatter(F.linear(x_block, w_block), 0, _group(grid, contract))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x_block, w_block = ctx.saved_tensors
        grid, contract = ctx.grid, ctx.contract
        grad_block = _gather(grad_y, 0, _group(grid, contract))
        grad_x = _scatter(grad_block @ w_block, 0, _group(grid, _OTHER[contract]))
        grad_w_block = grad_block.flatten(0, -2).T @ x_block.flatten(0, -2)
        grad_w = _scatter(grad_w_block, ctx.w_dim, _group(grid, I))
        return grad_x, grad_w, None, None


class Linear3D(nn.Module):
    """A bias-free nn.Linear on the 3-D grid: "colwise" takes LAYOUT_A to LAYOUT_B, "rowwise" B to A. `weight` is a
    DTensor of the full (out, in) shape, so state dict names and shapes are those of the nn.Linear it replaces."""

    grid: TPGrid
    style: str
    contract: str
    weight: nn.Parameter

    def __init__(self, linear: nn.Linear, grid: TPGrid, style: str, name: str | None = None) -> None:
        super().__init__()
        name = name or f"Linear(in_features={linear.in_features}, out_features={linear.out_features})"
        if style not in _CONTRACT:
            raise PlanError(
                f"tp_mode='3d' splits linears 'colwise' (layout A -> B) or 'rowwise' (B -> A); {name} has {style!r}"
            )
        if linear.bias is not None:
            raise PlanError(f"{name} has a bias, which tp_mode='3d' does not split; use bias=False")
        for what, size in (("in_features", linear.in_features), ("out_features", linear.out_features)):
            if size % grid.q**2:
                raise PlanError(f"tp_mode='3d' with q={grid.q} needs {name}.{what}={size} divisible by q^2={grid.q**2}")
        self.grid, self.style, self.contract = grid, style, _CONTRACT[style]
        self.weight = grid_parameter(linear.weight, grid, weight_placements(self.contract))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = cast(DTensor, self.weight).to_local()  # grid_parameter's Parameter wraps a DTensor
        if torch.is_autocast_enabled(x.device.type):  # as nn.Linear under autocast: the blocks move in its dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dtype), w.to(dtype)
        return _Matmul3D.apply(x, w, self.grid, self.contract)

    def extra_repr(self) -> str:
        out, in_ = self.weight.shape
        return f"in={in_}, out={out}, grid {self.grid.q}^3, {self.style} (layout {'A -> B' if self.style == 'colwise' else 'B -> A'})"


class ThreeDScheme:
    """tp_mode "3d" as a GridScheme (grid.py): between blocks LAYOUT_A; a linear's plan style says which
    way it turns the layout (the model's colwise/rowwise pairs bring it back)."""

    name = "3d"

    def layout(self, grid: TPGrid) -> ActivationLayout:
        return LAYOUT_A

    def linear(self, module: nn.Linear, grid: TPGrid, style: str) -> nn.Module:
        return Linear3D(module, grid, style)
