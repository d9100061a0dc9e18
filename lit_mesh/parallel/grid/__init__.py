"""Multi-dimensional tensor parallel (tp_mode "2d", "2.5d", "3d"): grid.py (the grid of tp ranks, the contract a
scheme's layers keep, the tp_mode/tp_depth checks), summa.py (2-D/2.5-D linear), cube.py (3-D linear), schemes.py
(tp_mode -> scheme), apply.py (a model's TensorPlan on the grid, DDP beside it), bytes.py (bytes per rank),
rules.py (what the grid combines with)."""

from lit_mesh.parallel.grid.apply import (
    average_over_replicas,
    check_grid_divides,
    grid_plan_problem,
    parallelize_grid,
)
from lit_mesh.parallel.grid.grid import (
    GRID_DIMS,
    TP_MODES,
    TPGrid,
    TPMode,
    build_grid,
    check_tp_mode,
    fits_grid,
    grid_shape,
    grid_sizes_near,
)
from lit_mesh.parallel.grid.schemes import SCHEMES

__all__ = [
    "GRID_DIMS",
    "SCHEMES",
    "TP_MODES",
    "TPGrid",
    "TPMode",
    "average_over_replicas",
    "build_grid",
    "check_grid_divides",
    "check_tp_mode",
    "fits_grid",
    "grid_plan_problem",
    "grid_shape",
    "grid_sizes_near",
    "parallelize_grid",
]
