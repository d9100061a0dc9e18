"""Named hangs in one process: the NCCL watchdog settings (defaults only where the user set nothing), and the
diagnosis from flight-recorder entries and the counts other ranks published (the dim, the operation, the ranks
that did not arrive). Across ranks: tests/integration/test_hangs.py (a rank hung on gloo)."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lit_mesh import hangs
from lit_mesh.hangs import CollectiveHangError, HangWatch, watchdog_environment


def test_nccl_gets_the_watchdog_and_flight_recorder_defaults() -> None:
    assert watchdog_environment("nccl", {}) == hangs.NCCL_WATCHDOG_DEFAULTS
    assert set(watchdog_environment("cpu:gloo,cuda:nccl", {})) == set(hangs.NCCL_WATCHDOG_DEFAULTS)
    assert watchdog_environment("gloo", {}) == {}


def test_what_the_user_set_is_kept_under_either_name() -> None:
    user = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert watchdog_environment("nccl", user) == {"TORCH_NCCL_ENABLE_MONITORING": "1"}


def _entry(group: str, seq: int, op: str, age_s: float, done: bool) -> dict[str, Any]:
    return {"process_group": (group, f"mesh_{group}"), "collective_seq_id": seq, "profiling_name": f"gloo:{op}",
            "time_created_ns": time.time_ns() - int(age_s * 1e9), "retired": done, "state": "scheduled", "is_p2p": False}  # fmt: skip


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> HangWatch:
    """Rank 0 of 2: it started all_reduce #3 on group "g1" (dp_shard) 20 s ago; rank 1 started only 2."""
    entries = [_entry("g1", 1, "all_reduce", 30, True), _entry("g1", 2, "all_gather", 25, True),
               _entry("g1", 3, "all_reduce", 20, False), _entry("g2", 1, "broadcast", 40, True)]  # fmt: skip
    monkeypatch.setattr(hangs, "_flight_recorder", lambda: entries)
    store = dist.HashStore()
    store.set("lit_mesh/hang/started/1", json.dumps({"g1": 2, "g2": 1}))
    return HangWatch(store, 0, 2, timedelta(seconds=10), {"g1": "dp_shard", "g2": "tp"})


def test_the_collective_open_past_the_timeout_is_named_with_the_ranks_that_did_not_arrive(watch: HangWatch) -> None:
    overdue = watch._refresh()
    assert overdue is not None and overdue["collective_seq_id"] == 3
    message = watch.diagnose(overdue)
    assert "collective all_reduce (#3) on mesh dim 'dp_shard' (ranks [0, 1])" in message
    assert "ranks that did not arrive: 1 (started 2 on it); ranks [0] waited in it" in message
    assert "timeout of 10 s" in message


def test_nothing_is_overdue_within_the_timeout(watch: HangWatch) -> None:
    watch.timeout = 60.0
    assert watch._refresh() is None


def test_torchs_timeout_error_becomes_the_named_error_on_every_rank(watch: HangWatch) -> None:
    watch._refresh()
    watch.store.set("lit_mesh/hang/seen/1", "1")  # rank 1's thread has read the report
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete")
    with pytest.raises(CollectiveHangError, match=r"all_reduce \(#3\) on mesh dim 'dp_shard'.*did not arrive: 1") as error:
        watch.on_exception(gloo)
    assert error.value.__cause__ is gloo
    assert "did not arrive: 1" in watch.store.get("lit_mesh/hang/report").decode(), "published for the other ranks"
    watch.on_exception(ValueError("not a timeout"))  # stopped: nothing more to say


def test_other_errors_pass_through(watch: HangWatch) -> None:
    watch.on_exception(ValueError("bad input"))  # no report, not a timeout: Lightning re-raises the error itself
    assert not watch.store.check(["lit_mesh/hang/report"])
