"""Multi-dimensional tensor parallel (tp_mode "2d", "2.5d", "3d"): the grid of tp ranks, and the contract every
scheme's layers keep. The model integration (lit_mesh/parallel/grid/apply.py) works for any scheme that keeps it.

The grid. The tp ranks (the innermost mesh dim) are reshaped into three named dims, outermost first:

    GRID_DIMS = ("tp_depth", "tp_row", "tp_col"), sizes (depth, q, q)
    "2d":   depth = 1,  tp = q * q        (SUMMA)
    "2.5d": depth = d,  tp = d * q * q    (Tesseract: depth replicates the weight blocks, splits the batch)
    "3d":   depth = q,  tp = q * q * q

`build_grid` unflattens the run's root mesh's "tp" dim into these (every rank builds the same DeviceMesh, and the
tp rank t sits at (t // q^2, (t // q) % q, t % q)); `TPGrid` holds the grid mesh and its groups.

The layer contract. A scheme is a `GridScheme`: its `linear(module, grid, style)` returns an nn.Module replacing an
nn.Linear (weight (out, in), bias or None) that
  - keeps the parameter name(s) `weight` (and `bias`) with the full shape, as DTensors on `grid.mesh`, so state
    dicts, DCP checkpoints, clipping and optimizers see the single-device names and shapes;
  - takes and returns activations in the scheme's `layout`: a local block of (batch, ..., features) whose batch
    dim is split over the grid dims `layout.batch` and whose last dim over `layout.features` (each in the order
    given, outermost first; dims in neither replicate it); in and out features split the same way, so the
    residual stream keeps one layout between blocks (3-D: a "colwise" linear returns a second layout and the
    "rowwise" one after it brings the activations back);
  - leaves each weight's .grad the full gradient of its own block (reduced inside its backward over every rank
    that computed a part of it), so nothing else reduces weight gradients.
2-D and 2.5-D: layout batch over ("tp_depth", "tp_row"), features over ("tp_col",) (lit_mesh/parallel/grid/summa.py).
3-D: layout batch over ("tp_row", "tp_col"), features over ("tp_depth",) (lit_mesh/parallel/grid/cube.py).
A scheme joins by its entry in lit_mesh/parallel/grid/schemes.py's SCHEMES (tp_mode -> GridScheme; the option checks
and rules read that table) and its bytes per block in lit_mesh/parallel/grid/bytes.py's GRID_BLOCK_BYTES.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, distribute_tensor

from lit_mesh.errors import MeshConfigError
from lit_mesh.mesh import group_pool

TPMode = Literal["1d", "2d", "2.5d", "3d"]
TP_MODES: tuple[str, ...] = ("1d", "2d", "2.5d", "3d")
GRID_DIMS = ("tp_depth", "tp_row", "tp_col")


def check_tp_mode(tp_mode: str, tp_depth: int | None) -> None:
    """The values alone (MeshStrategy.__init__); their fit with tp is the rule "tp_grid_shape" (grid/rules.py)."""
    if tp_mode not in TP_MODES:
        raise MeshConfigError(f"tp_mode={tp_mode!r} is not one of {list(TP_MODES)}")
    if tp_depth is not None and (isinstance(tp_depth, bool) or not isinstance(tp_depth, int) or tp_depth < 1):
        raise MeshConfigError(f"tp_depth={tp_depth!r} must be a positive int (the 2.5-D depth d, tp = d * q * q)")
    if tp_depth is not None and tp_mode != "2.5d":
        raise MeshConfigError(
            f"tp_depth={tp_depth} is the depth of tp_mode='2.5d'; with tp_mode={tp_mode!r} leave it unset"
        )
    if tp_mode == "2.5d" and (tp_depth is None or tp_depth < 2):
        raise MeshConfigError(
            f"tp_mode='2.5d' needs tp_depth=d >= 2 (tp = d * q * q), not {tp_depth}; e.g. tp=8, tp_depth=2"
            " (depth 1 is tp_mode='2d')"
        )


def _root(n: int, power: int) -> int | None:
    """The integer r with r ** power == n, or None."""
    r = round(n ** (1 / power))
    return next((c for c in (r - 1, r, r + 1) if c > 0 and c**power == n), None)


def grid_shape(tp: int, tp_mode: str, tp_depth: int | None) -> tuple[int, int] | None:
    """(depth, q) of the grid for `tp` ranks, or None where tp does not fit the scheme ("1d": (1, 1), no grid)."""
    if tp_mode == "1d":
        return 1, 1
    if tp_mode == "2d":
        q = _root(tp, 2)
        return (1, q) if q else None
    if tp_mode == "3d":
        q = _root(tp, 3)
        return (q, q) if q else None
    d = tp_depth or 1  # check_tp_mode requires it for "2.5d"
    q = _root(tp // d, 2) if tp % d == 0 else None
    return (d, q) if q else None


def fits_grid(tp: int, tp_mode: str, tp_depth: int | None) -> bool:
    """tp ranks form a grid of the scheme with q >= 2 (a 1 x 1 grid splits nothing)."""
    shape = grid_shape(tp, tp_mode, tp_depth)
    return shape is not None and shape[1] > 1


def grid_sizes_near(tp: int, tp_mode: str, tp_depth: int | None) -> list[int]:
    """tp sizes up to max(64, 2 tp) that fit the scheme: for the error message."""
    return [n for n in range(2, max(64, 2 * tp) + 1) if fits_grid(n, tp_mode, tp_depth)]


@dataclass(frozen=True)
class ActivationLayout:
    """How a scheme splits the activations between its layers (see the module doc): grid dims, outermost first."""

    batch: tuple[str, ...]
    features: tuple[str, ...]


@dataclass(frozen=True)
class TPGrid:
    """The grid of this run's tp ranks: `mesh` has the dims GRID_DIMS; `tp` is the flat tp mesh (same ranks)."""

    mode: str
    depth: int
    q: int
    mesh: DeviceMesh
    tp: DeviceMesh
    _groups: dict = field(default_factory=dict, compare=False, repr=False)

    def size(self, name: str) -> int:
        return self.mesh.size(GRID_DIMS.index(name))

    def group(self, names: tuple[str, ...]) -> Optional[dist.ProcessGroup]:
        """The process group over the grid dims `names` (several: flattened, outermost first); size-1 dims are
        dropped, None where nothing is left. Made on first use: every rank asks for the same groups in order."""
        names = tuple(n for n in names if self.size(n) > 1)
        if not names:
            return None
        if names not in self._groups:
            with group_pool(self.mesh).making():  # the run's timeout, one communicator per set of ranks
                mesh = self.mesh[names[0]] if len(names) == 1 else self.mesh[names]._flatten("_".join(names))
            self._groups[names] = mesh.get_group()
        return self._groups[names]

    def coordinate(self, name: str) -> int:
        return self.mesh.get_local_rank(name)

    def coordinates_of(self, tp_rank: int) -> dict[str, int]:
        """The grid coordinates of rank `tp_rank` of the tp group (row-major over GRID_DIMS)."""
        coords = {}
        for name in reversed(GRID_DIMS):
            tp_rank, coords[name] = divmod(tp_rank, self.size(name))
        return coords

    def index(self, names: tuple[str, ...], coords: Optional[dict[str, int]] = None) -> tuple[int, int]:
        """(block index, number of blocks) along the grid dims `names` (row-major, outermost first) of the rank at
        `coords` (default: this rank)."""
        index, count = 0, 1
        for name in names:
            at = self.coordinate(name) if coords is None else coords[name]
            index, count = index * self.size(name) + at, count * self.size(name)
        return index, count


def build_grid(root: DeviceMesh, tp_mode: str, depth: int, q: int) -> TPGrid:
    """Split the root mesh's "tp" dim into GRID_DIMS; a collective: every rank calls it, in the same order. One grid
    per root mesh and shape (its process groups are made once; later models on the same mesh share them)."""
    key = (tp_mode, depth, q)
    grids = _GRIDS.setdefault(root, {})
    if key not in grids:
        with group_pool(root).making():
            unflattened = root._unflatten("tp", (depth, q, q), GRID_DIMS)
        grids[key] = TPGrid(tp_mode, depth, q, unflattened[GRID_DIMS], root["tp"])
    return grids[key]


_GRIDS: weakref.WeakKeyDictionary[DeviceMesh, dict[tuple, TPGrid]] = weakref.WeakKeyDictionary()


class GridScheme(Protocol):
    """One multi-dimensional TP scheme (module doc: the contract its linear layers keep)."""

    name: str

    def layout(self, grid: TPGrid) -> ActivationLayout: ...

    def linear(self, module: nn.Linear, grid: TPGrid, style: str) -> nn.Module:
        """`style`: the plan's "colwise" or "rowwise" (SUMMA treats both alike; 3-D turns the layout one way or back)."""


def grid_parameter(tensor: torch.Tensor, grid: TPGrid, placements: Sequence[Placement]) -> nn.Parameter:
    """A parameter as a DTensor on the grid; each rank keeps its slice of `tensor` (no communication; meta stays meta)."""
    return nn.Parameter(distribute_tensor(tensor.data, grid.mesh, placements, src_data_rank=None))


def local_block(full: torch.Tensor, grid: TPGrid, dim: int, names: tuple[str, ...]) -> torch.Tensor:
    """This rank's block of `full` along tensor dim `dim`, split over the grid dims `names` (no communication)."""
    index, count = grid.index(names)
    size = full.shape[dim]
    if size % count:
        raise ValueError(f"size {size} of dim {dim} does not split into {count} blocks over {names}")
    return full.narrow(dim, index * (size // count), size // count)
