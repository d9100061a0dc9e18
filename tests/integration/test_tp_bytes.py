"""1-D tensor parallel sends Megatron's bytes and calls, with and without sequence parallelism, for the zoo GPT and
transformers' Llama, and computes what one device computes (tests/workers/tp_bytes.py: one launch of 2 ranks)."""

from __future__ import annotations

import pytest

from tests.worker_checks import CheckResults, check_names, launch_checks


@pytest.fixture(scope="module")
def tp_bytes_checks(request: pytest.FixtureRequest) -> CheckResults:
    return launch_checks(request, "tp_bytes.py", nproc=2, timeout=300)


@pytest.mark.parametrize("check", check_names("tp_bytes.py"))
def test_tp_bytes(tp_bytes_checks: CheckResults, check: str) -> None:
    tp_bytes_checks.assert_passed(check)
