"""The grid tp_modes over gloo (tests/workers/tp_grid.py), one launch of 8 ranks running every check: 2-D on two
replicas of a 2 x 2 grid (each grid 4 ranks), 2.5-D and 3-D on a 2 x 2 x 2 grid. SUMMA and 3-D linears against
nn.Linear (outputs, input and weight gradients), the zoo GPT's losses against one device over 10 steps (2.5-D and
3-D; 2-D's runs through MeshStrategy and the CLI on 4 ranks: tests/integration/test_parity.py, variant tp4-2d), DCP
round trips, and bytes per rank against lit_mesh/parallel/grid/bytes.py (with 1-D's on the same tp ranks)."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks


@pytest.fixture(scope="module")
def grid_checks(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, "tp_grid.py", nproc=8, timeout=300)


@pytest.mark.parametrize("check", check_names("tp_grid.py"))
def test_tp_grid(grid_checks: CheckResults, check: str) -> None:
    grid_checks.assert_passed(check)
