"""The worker-check runner (tests/workers/checks.py, tests/worker_checks.py) in one process: names come from the
source, selected checks run in registration order, and a failure names its check and rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.worker_checks import CheckResults, check_names
from tests.workers.checks import Checks


def test_check_names_are_read_from_the_worker_source() -> None:
    names = check_names("compression_units.py")
    assert len(names) == len(set(names)) == 13
    assert "powersgd_sums_rank_r_matrices_exactly" in names and "reduce_scatter_formula" not in names  # a helper
    assert check_names("topology_units.py")[0] == "strategy_reads_slurm"


def test_selected_checks_run_in_registration_order_and_failures_are_kept(tmp_path: Path) -> None:
    check, ran = Checks(), []

    @check
    def first() -> None:
        ran.append("first")

    @check
    def broken() -> None:
        ran.append("broken")
        raise AssertionError("3 != 4")

    @check
    def last() -> None:
        ran.append("last")

    check.run(["last", "broken"])
    assert ran == ["broken", "last"]
    check.write(tmp_path, rank=1)
    results = json.loads((tmp_path / "rank1.json").read_text())
    assert results["last"] == "ok" and "AssertionError: 3 != 4" in results["broken"] and "first" not in results


def test_a_failure_names_the_check_and_the_rank(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps({"a": "ok", "b": "ok"}))
    (tmp_path / "rank1.json").write_text(json.dumps({"a": "ok", "b": "Traceback ... ValueError: bad"}))
    results = CheckResults(tmp_path, world_size=2)
    results.assert_passed("a")
    with pytest.raises(AssertionError, match=r"worker check 'b' failed\nrank 1:\nTraceback ... ValueError: bad"):
        results.assert_passed("b")
    with pytest.raises(AssertionError, match=r"rank 0: check 'c' did not report"):
        results.assert_passed("c")
    with pytest.raises(AssertionError, match=r"rank 2: check 'a' did not report"):
        CheckResults(tmp_path, world_size=3).assert_passed("a")
