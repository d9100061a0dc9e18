"""float8 training through torchao, emulated on CPU: fsdp4, and fsdp2 x tp2 with compile and activation
checkpointing; loss near fp32 (over 50 steps on fsdp2 x tp2, 15 on the others), checkpoints resume, the layout print
lists the converted linears (tests/workers/float8_runs.py; one launch of 4 ranks for every check)."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks

pytest.importorskip("torchao", reason="torchao is not installed: pip install 'lit-mesh[fp8]'")


@pytest.fixture(scope="module")
def float8_runs(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, "float8_runs.py", nproc=4, timeout=900)


@pytest.mark.parametrize("check", check_names("float8_runs.py"))
def test_float8_training(float8_runs: CheckResults, check: str) -> None:
    float8_runs.assert_passed(check)
