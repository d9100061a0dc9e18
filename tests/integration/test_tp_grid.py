"""The grid tp_modes over gloo (tests/workers/tp_grid.py): one launch of 4 ranks (2-D, a 2 x 2 grid) and one of 8
(2.5-D, depth 2 x 2 x 2), each running every check: SUMMA linear against nn.Linear (outputs, input and weight
gradients), the zoo GPT's losses against one device over 10 steps, a DCP round trip, and bytes per rank against
lit_mesh/parallel/tensor_nd_bytes.py (with 1-D's on the same ranks). The CLI run of tp_mode=2d through
MeshStrategy is in tests/integration/test_parity.py (variant tp4-2d)."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks


@pytest.fixture(scope="module", params=[4, 8], ids=["2d", "2.5d"])
def grid_checks(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, "tp_grid.py", nproc=request.param, timeout=300)


@pytest.mark.parametrize("check", check_names("tp_grid.py"))
def test_tp_grid(grid_checks: CheckResults, check: str) -> None:
    grid_checks.assert_passed(check)
