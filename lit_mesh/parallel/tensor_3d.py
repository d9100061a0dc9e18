"""3-D tensor parallel (Agarwal et al. 1995; Colossal-AI's 3-D TP): tp = q^3 ranks as a q x q x q grid (i, j, l).

A linear C = A B is cut into q x q blocks; rank (i, j, l) multiplies A_ij by B_jl and the j ranks sum their
products into C_il. Every block is held split a further 1/q by the grid dim that does not index it, so
nothing is stored twice:
- activations (rows, ..., features): rows (the batch) split q^2 ways, i-major; features split q ways. In
  layout A features go by j and the rows' second split by l; in layout B the two swap. A linear with
  `contract="j"` takes A to B (all-gather rows over l, the weight over i; reduce-scatter the product over j),
  `contract="l"` takes B to A; so alternate linears keep the residual stream in layout A.
- weights W (out, in): the in dim goes by `contract`, the out dim by the other of j and l, and the dim that
  goes by j is split again by i. On the mesh (j, i, l) that is DTensor's left-to-right nested Shard, so a
  weight is an ordinary DTensor (checkpoints, clipping and optimizers see its global shape).
Backward mirrors forward: each all-gather becomes a reduce-scatter over the same dim and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from lit_mesh.errors import PlanError

# mesh order: j before i (the nested weight split, j-major), i before l (the flattened (i, l) group)
GRID_DIMS = ("tp3d_j", "tp3d_i", "tp3d_l")
_OTHER = {"j": "l", "l": "j"}


def cube_root(tp: int) -> int:
    q = round(tp ** (1 / 3))
    if q**3 != tp:
        cubes = [n**3 for n in range(1, 6)]
        raise PlanError(f"tp_mode='3d' needs tp = q^3 (a q x q x q grid), got tp={tp}; choose tp in {cubes}")
    return q


@dataclass(frozen=True, eq=False)
class Grid3D:
    """The q x q x q grid over the tp ranks: `mesh` has dims GRID_DIMS (tp rank = j q^2 + i q + l)."""

    mesh: DeviceMesh
    q: int
    tp_group: ProcessGroup

    @classmethod
    def from_tp_mesh(cls, tp_mesh: DeviceMesh) -> Grid3D:
        """Every rank builds the same grid (an unflattening of the tp dim: other tp groups' grids come with it)."""
        q = cube_root(tp_mesh.size())
        return cls(tp_mesh._unflatten(0, (q, q, q), GRID_DIMS), q, tp_mesh.get_group())

    def group(self, dim: str) -> ProcessGroup:
        return self.mesh.get_group(f"tp3d_{dim}")

    def coordinate(self, dim: str) -> int:
        return self.mesh.get_local_rank(f"tp3d_{dim}")

    @cached_property
    def rows_group(self) -> ProcessGroup:
        """(i, l): the ranks that share a layout-A feature block (a norm weight's gradient is summed over them)."""
        return self.mesh["tp3d_i", "tp3d_l"]._flatten("tp3d_il").get_group()

    def weight_placements(self, contract: str) -> list[Placement]:
        """W (out, in): in by `contract`, out by the other; the dim that goes by j split again by i (mesh j, i, l)."""
        j_dim = 1 if contract == "j" else 0
        by = {"j": Shard(j_dim), "i": Shard(j_dim), "l": Shard(1 - j_dim)}
        return [by[name.removeprefix("tp3d_")] for name in GRID_DIMS]

    def row_chunk(self, layout: str) -> int:
        """Which of the q^2 row chunks this rank holds: i-major, then the layout's second split (A: l, B: j)."""
        return self.coordinate("i") * self.q + self.coordinate("l" if layout == "A" else "j")

    def feature_block(self, layout: str) -> int:
        return self.coordinate("j" if layout == "A" else "l")


def _gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), dim, group))


def _scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.reduce_scatter_single(x.contiguous(), "sum", dim, group))


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


class _Matmul3D(torch.autograd.Function):
    """y = x w^T on the grid: x's rows gathered over the other dim, w over i, the product reduce-scattered over
    `contract`. The gathered x and w are kept for backward (no second gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, grid: Grid3D, contract: str) -> torch.Tensor:  # type: ignore[override]
        other, w_dim = _OTHER[contract], 1 if contract == "j" else 0
        x_block = _gather(x, 0, grid.group(other))  # A_ij (or its B-layout mirror)
        w_block = _gather(w, w_dim, grid.group("i"))  # B_jl
        ctx.save_for_backward(x_block, w_block)
        ctx.grid, ctx.contract, ctx.w_dim = grid, contract, w_dim
        return _scatter(F.linear(x_block, w_block), 0, grid.group(contract))

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        x_block, w_block = ctx.saved_tensors
        grid, contract = ctx.grid, ctx.contract
        grad_block = _gather(grad_y, 0, grid.group(contract))
        grad_x = _scatter(grad_block @ w_block, 0, grid.group(_OTHER[contract]))
        grad_w_block = grad_block.flatten(0, -2).T @ x_block.flatten(0, -2)
        grad_w = _scatter(grad_w_block, ctx.w_dim, grid.group("i"))
        return grad_x, grad_w, None, None


class Linear3D(nn.Module):
    """A bias-free linear on the grid; `contract="j"` takes layout A to B, `"l"` B to A. `weight` is a DTensor
    of the full (out, in) shape, so the state dict keys and shapes are those of the nn.Linear it replaces."""

    def __init__(self, weight: DTensor, grid: Grid3D, contract: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.grid, self.contract = grid, contract

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: Grid3D, contract: str, name: str = "linear") -> Linear3D:
        if contract not in _OTHER:
            raise PlanError(f"{name}: contract={contract!r} is not 'j' (layout A -> B) or 'l' (B -> A)")
        if linear.bias is not None:
            raise PlanError(f"{name} has a bias, which tp_mode='3d' does not split; use bias=False")
        for what, size in (("in_features", linear.in_features), ("out_features", linear.out_features)):
            if size % grid.q**2:
                raise PlanError(f"tp_mode='3d' with q={grid.q} needs {name}.{what}={size} divisible by q^2={grid.q**2}")
        weight = distribute_tensor(linear.weight.detach(), grid.mesh, grid.weight_placements(contract))
        return cls(weight, grid, contract)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Matmul3D.apply(x, self.weight.to_local(), self.grid, self.contract)

    def extra_repr(self) -> str:
        out, in_ = self.weight.shape
        return f"in_features={in_}, out_features={out}, q={self.grid.q}, layout {'A -> B' if self.contract == 'j' else 'B -> A'}"


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group` (a parameter shared by ranks that saw other rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class _SumBothWays(torch.autograd.Function):
    """All-reduce forward and backward: every rank's output depends on every rank's part (a norm's sum of
    squares), so each part's gradient is the sum of what all ranks send back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class RMSNorm3D(nn.Module):
    """RMSNorm in layout A: the features go by j, so the sum of squares is all-reduced over j; the weight
    (features by j, replicated over i and l) has its gradient summed over (i, l)."""

    def __init__(self, weight: DTensor, grid: Grid3D, eps: float | None, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.grid, self.eps, self.dim = grid, eps, dim

    @classmethod
    def from_norm(cls, norm: nn.RMSNorm, grid: Grid3D, name: str = "norm") -> RMSNorm3D:
        (dim,) = norm.normalized_shape
        if dim % grid.q or norm.weight is None:
            raise PlanError(f"tp_mode='3d' needs {name} with an elementwise weight and dim={dim} divisible by q={grid.q}")
        placements = [Shard(0) if grid_dim == "tp3d_j" else Replicate() for grid_dim in GRID_DIMS]
        return cls(distribute_tensor(norm.weight.detach(), grid.mesh, placements), grid, norm.eps, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = _SumBothWays.apply(x.float().pow(2).sum(-1, keepdim=True), self.grid.group("j"))
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        normed = (x.float() * torch.rsqrt(squares / self.dim + eps)).type_as(x)
        return normed * _SumGrad.apply(self.weight.to_local(), self.grid.rows_group)


class _ToLayoutA(torch.autograd.Function):
    """A tensor every tp rank holds whole (rows, ..., features) -> this rank's layout-A piece. Backward gathers
    the pieces' gradients from the whole grid: the producer upstream ran the same on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grid: Grid3D) -> torch.Tensor:  # type: ignore[override]
        ctx.grid = grid
        return piece(x, grid, "A")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _gather_whole(grad, ctx.grid), None


class _FromLayoutA(torch.autograd.Function):
    """This rank's layout-A piece -> the whole tensor on every tp rank. Backward keeps the piece's own gradient:
    the consumer downstream ran the same on every rank, so each holds the whole gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grid: Grid3D) -> torch.Tensor:  # type: ignore[override]
        ctx.grid = grid
        return _gather_whole(x, grid)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return piece(grad, ctx.grid, "A"), None


def piece(x: torch.Tensor, grid: Grid3D, layout: str) -> torch.Tensor:
    """This rank's piece of a whole (rows, ..., features) tensor in layout "A" or "B" (a copy)."""
    rows, features = x.shape[0] // grid.q**2, x.shape[-1] // grid.q
    x = x.narrow(0, grid.row_chunk(layout) * rows, rows)
    return x.narrow(-1, grid.feature_block(layout) * features, features).contiguous()


def _gather_whole(piece: torch.Tensor, grid: Grid3D) -> torch.Tensor:
    q = grid.q
    pieces = _gather(piece, 0, grid.tp_group).view(q, q, q, *piece.shape)  # (j, i, l, rows / q^2, ..., features / q)
    whole = pieces.movedim(0, -2)  # (i, l, rows / q^2, ..., j, features / q): rows i-major, features by j
    return whole.reshape(q * q * piece.shape[0], *piece.shape[1:-1], q * piece.shape[-1])


def to_layout_a(x: torch.Tensor, grid: Grid3D, name: str = "the input") -> torch.Tensor:
    if x.shape[0] % grid.q**2 or x.shape[-1] % grid.q:
        raise PlanError(
            f"tp_mode='3d' with q={grid.q} splits the batch q^2={grid.q**2} ways and the features q ways: {name} has"
            f" batch {x.shape[0]} and {x.shape[-1]} features; use a batch size divisible by {grid.q**2}"
        )
    return _ToLayoutA.apply(x, grid)


def from_layout_a(x: torch.Tensor, grid: Grid3D) -> torch.Tensor:
    return _FromLayoutA.apply(x, grid)
