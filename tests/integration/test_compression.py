"""Gradient compressors over a real gloo group: one 2-rank launch of tests/workers/compression_units.py, one
pytest id per check (e.g. `pytest tests/integration/test_compression.py -k powersgd`)."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks


@pytest.fixture(scope="module")
def compressors_over_gloo(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, "compression_units.py", nproc=2, timeout=180)


@pytest.mark.parametrize("check", check_names("compression_units.py"))
def test_compressors_over_gloo(compressors_over_gloo: CheckResults, check: str) -> None:
    """2 ranks: the two-stage 1-bit all-reduce equals its formula; top-k and fp16 reduce-scatters equal theirs;
    PowerSGD sums rank-r matrices exactly; nothing is lost across steps and mode switches; bytes counted."""
    compressors_over_gloo.assert_passed(check)
