"""Named hangs in one process: the NCCL watchdog settings (defaults only where the user set nothing), and the
diagnosis from flight-recorder entries and the counts other ranks published (the dim, the operation, the ranks
that did not arrive). Across ranks: tests/integration/test_hangs.py (a rank hung on gloo)."""

from __future__ import annotations

import json
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lit_mesh.reliability import hangs
from lit_mesh.reliability.hangs import CollectiveHangError, HangWatch, watchdog_environment


def test_nccl_gets_the_watchdog_and_flight_recorder_defaults() -> None:
    assert watchdog_environment("nccl", {}) == hangs.NCCL_WATCHDOG_DEFAULTS
    assert set(watchdog_environment("cpu:gloo,cuda:nccl", {})) == set(hangs.NCCL_WATCHDOG_DEFAULTS)
    assert watchdog_environment("gloo", {}) == {}


def test_flight_recorder_dumps_go_under_the_run_directory(tmp_path: Path) -> None:
    dumps = watchdog_environment("nccl", {}, tmp_path)[hangs.DUMP_PREFIX]
    assert dumps == str(tmp_path / "nccl_flight_recorder" / "rank_") and not dumps.startswith("/tmp/nccl")
    assert hangs.DUMP_PREFIX not in watchdog_environment("nccl", {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/"}, tmp_path)


def test_what_the_user_set_is_kept_under_either_name() -> None:
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert watchdog_environment("nccl", user) == {"TORCH_NCCL_ENABLE_MONITORING": "1"}


def _entry(group: str, seq: int, op: str, age_s: float, done: bool) -> dict[str, Any]:
    return {
        "process_group": (group, f"mesh_{group}"),
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}",
        "time_created_ns": time.time_ns() - int(age_s * 1e9),
        "retired": done,
        "state": "scheduled",
        "is_p2p": False,
    }


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> HangWatch:
    """Rank 0 of 2: it started all_reduce #3 on group "g1" (dp_shard); rank 1 started only 2 there."""
    entries = [
        _entry("g1", 1, "all_reduce", 30, True),
        _entry("g1", 2, "all_gather", 25, True),
        _entry("g1", 3, "all_reduce", 20, False),
        _entry("g2", 1, "broadcast", 40, True),
    ]
    monkeypatch.setattr(hangs, "_flight_recorder", lambda: entries)
    store = dist.HashStore()
    store.set("lit_mesh/hang/started/1", json.dumps({"g1": 2, "g2": 1}))
    return HangWatch(store, 0, 2, timedelta(seconds=10), {"g1": "dp_shard", "g2": "tp"})


def test_the_first_collective_a_rank_did_not_start_is_named_with_that_rank(watch: HangWatch) -> None:
    watch._refresh()
    message = watch.diagnose()
    assert message is not None
    assert "collective all_reduce (#3) on mesh dim 'dp_shard' (ranks [0, 1])" in message
    assert "ranks that did not arrive: 1 (started 2 on it); ranks [0] waited in it" in message
    assert "timeout of 10 s" in message


def test_a_rank_that_does_not_answer_is_named_too(watch: HangWatch) -> None:
    watch.store.delete_key("lit_mesh/hang/started/1")
    watch._refresh()
    assert "ranks that did not arrive: 1 (no answer)" in (watch.diagnose() or "")


def test_torchs_timeout_error_becomes_the_named_error_on_every_rank(
    watch: HangWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    watch.store.set("lit_mesh/hang/seen/1", "1")  # rank 1's thread has read the report
    gloo = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
    )
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.update({signum: handler}))
    installed: dict = {}
    with pytest.raises(
        CollectiveHangError, match=r"all_reduce \(#3\) on mesh dim 'dp_shard'.*did not arrive: 1"
    ) as error:
        watch.on_exception(gloo)
    # the launcher's SIGTERM (rank 1 exits once it has seen the report) must not replace the error on its way out
    assert installed == {signal.SIGTERM: signal.SIG_IGN}
    assert error.value.__cause__ is gloo
    assert watch.store.check(["lit_mesh/hang/request", "lit_mesh/hang/started/0"]), "every rank was asked"
    assert "did not arrive: 1" in watch.store.get("lit_mesh/hang/report").decode(), "published for the other ranks"
    watch.on_exception(ValueError("not a timeout"))  # stopped: nothing more to say


def test_other_errors_and_timeouts_without_a_missing_rank_pass_through(watch: HangWatch) -> None:
    watch.on_exception(ValueError("bad input"))  # Lightning re-raises the error itself
    assert not watch.store.check(["lit_mesh/hang/report"])
    watch.poll = 0.5  # rank 1 answers (below); the wait for answers is a few polls
    watch.store.set("lit_mesh/hang/started/1", json.dumps({"g1": 3, "g2": 1}))  # rank 1 started all_reduce #3 too
    watch.on_exception(RuntimeError("Timed out waiting 10000ms for recv operation to complete"))  # slow, not missing
    assert not watch.store.check(["lit_mesh/hang/report"])
