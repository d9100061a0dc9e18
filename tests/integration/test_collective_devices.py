"""No host tensor in a collective (#33 item 2), on 2 gloo ranks: the proxy of tests/collective_devices.py fails where
NCCL would, and the paths that made host tensors (the gradient norm of a rank without gradients) no longer do
(tests/workers/collective_devices.py). Every layout of tests/integration/test_host_sync.py runs under it too."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks

SCRIPT = "collective_devices.py"


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, SCRIPT, nproc=2, timeout=180)


@pytest.mark.parametrize("check", check_names(SCRIPT))
def test_collective_devices(results: CheckResults, check: str) -> None:
    results.assert_passed(check)
