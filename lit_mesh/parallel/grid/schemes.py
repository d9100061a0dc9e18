"""tp_mode -> its GridScheme: the table a new grid scheme joins (the option checks and rules read it, the plan on the
grid applies it)."""

from __future__ import annotations

from lit_mesh.parallel.grid.cube import ThreeDScheme
from lit_mesh.parallel.grid.grid import GridScheme
from lit_mesh.parallel.grid.summa import SummaScheme

SCHEMES: dict[str, GridScheme] = {"2d": SummaScheme(), "2.5d": SummaScheme(), "3d": ThreeDScheme()}
