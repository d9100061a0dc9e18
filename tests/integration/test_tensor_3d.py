"""3-D tensor parallel (tp_mode="3d", q = 2): one 8-rank gloo launch of tests/workers/tp3d_checks.py, one pytest id
per check (e.g. `pytest tests/integration/test_tensor_3d.py -k rowwise`)."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks


@pytest.fixture(scope="module")
def tp3d_over_gloo(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, "tp3d_checks.py", nproc=8, timeout=240)


@pytest.mark.parametrize("check", check_names("tp3d_checks.py"))
def test_tensor_3d_over_gloo(tp3d_over_gloo: CheckResults, check: str) -> None:
    """8 ranks as a 2 x 2 x 2 grid: the 3-D linears (both directions), norm and MLP match nn modules forward and
    backward; the byte counter equals bytes_3d."""
    tp3d_over_gloo.assert_passed(check)
