"""Process groups on 4 gloo ranks: every group lit-mesh makes carries MeshStrategy's timeout (not torch's default),
and ranks shared by several dims or views get one communicator (tests/workers/mesh_groups.py)."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks

SCRIPT = "mesh_groups.py"


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, SCRIPT, nproc=4, timeout=180)


@pytest.mark.parametrize("check", check_names(SCRIPT))
def test_mesh_groups(results: CheckResults, check: str) -> None:
    results.assert_passed(check)
