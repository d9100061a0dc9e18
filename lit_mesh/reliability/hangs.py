"""Hangs are named: a collective that does not complete within the strategy's timeout ends every rank with an
error naming the mesh dim, the operation and the ranks that did not arrive.

torch's flight recorder (on by default on gloo and NCCL: the last TORCH_FR_BUFFER_SIZE collectives of the
process) records each collective a process group starts, its per-group sequence number and whether it
completed. It cannot see which *other* ranks never started one, and gloo's timeout error ("Timed out waiting
30000ms for recv operation") names neither the group nor the peers. So:
- when torch's timeout error reaches a rank's main thread (`MeshStrategy.on_exception`), that rank asks every
  rank, through the rendezvous store, how many collectives it has started per group (each rank's `HangWatch`
  thread answers from its flight recorder within `poll` seconds); the ranks of a group behind this rank's count
  did not arrive. The report goes into the store and is raised as CollectiveHangError;
- every rank's thread that reads the report prints it and ends its process (exit 1): the rank that did not
  arrive too, whatever it is stuck in (a thread, because such a rank never returns to Python code of ours).
NCCL: torch's own watchdog ends a timed-out collective; `watchdog_environment` switches on its error handling
and flight-recorder dumps when the user has not set them (README, "Reliability").
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

_KEY = "lit_mesh/hang"  # store keys: {_KEY}/request, {_KEY}/started/{rank}, {_KEY}/report, {_KEY}/seen/{rank}

# torch's NCCL watchdog and flight recorder: set where the user has not (names: torch/csrc/distributed/c10d/
# ProcessGroupNCCL.hpp and FlightRecorder.hpp)
NCCL_WATCHDOG_DEFAULTS = {
    # a failed or timed-out collective aborts the communicators and ends the process (3: without cleanup)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # the flight recorder keeps the last 2000 collectives of each process (TORCH_FR_BUFFER_SIZE is its new name)
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    # on a timeout every rank writes its flight recorder to TORCH_FR_DUMP_TEMP_FILE<rank> (set under the run's
    # directory by watchdog_environment; torch's default is /tmp/nccl_trace_rank_)
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # the monitor thread that dumps, and ends a rank whose watchdog itself is stuck (needed by DUMP_ON_TIMEOUT)
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}
# where each rank's flight recorder is dumped: torch appends the rank to this prefix
DUMP_PREFIX = "TORCH_FR_DUMP_TEMP_FILE"
_ALIASES = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE", DUMP_PREFIX: "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
DUMP_DIRECTORY = "nccl_flight_recorder"  # under the run's directory


def watchdog_environment(
    backend: str, environ: Mapping[str, str], run_directory: Optional[Path] = None
) -> dict[str, str]:
    """The NCCL watchdog and flight-recorder settings to add to `environ` before the process group starts:
    those the user has not set (under either of their names); nothing for other backends. With `run_directory`
    the dumps go under it, never to torch's fixed /tmp/nccl_trace_rank_<rank> (another user's file, or a link
    planted there, would be written over)."""
    if "nccl" not in backend:
        return {}
    defaults = dict(NCCL_WATCHDOG_DEFAULTS)
    if run_directory is not None:
        defaults[DUMP_PREFIX] = str(run_directory / DUMP_DIRECTORY / "rank_")
    return {
        name: value
        for name, value in defaults.items()
        if name not in environ and _ALIASES.get(name, name) not in environ
    }


def use_watchdog_defaults(backend: str, run_directory: Optional[Path] = None) -> None:
    """Put `watchdog_environment` into this process's environment (torch reads it when the group starts)."""
    added = watchdog_environment(backend, os.environ, run_directory)
    if DUMP_PREFIX in added:
        Path(added[DUMP_PREFIX]).parent.mkdir(parents=True, exist_ok=True)
    os.environ.update(added)


class CollectiveHangError(RuntimeError):
    """A collective that did not complete within the timeout, with the mesh dim, the operation and the ranks
    that did not arrive."""


def group_names(views: Any) -> dict[str, str]:
    """Process group name -> the mesh dims it serves ("dp_shard / dp_shard_cp"), from lit_mesh.mesh.MeshViews."""
    names: dict[str, list[str]] = {}
    for mesh in (views.root, views.dp, views.dp_shard_cp, views.dp_cp, views.hsdp, views.ep, views.expert_dp):
        for dim in mesh.mesh_dim_names or ():
            group = mesh.get_group(dim)
            dims = names.setdefault(group.group_name, [])
            if dim not in dims:
                dims.append(dim)
    if dist.is_initialized():
        names.setdefault(dist.group.WORLD.group_name, []).append("world")  # type: ignore[union-attr]
    return {group: " / ".join(dims) for group, dims in names.items()}


def _flight_recorder() -> list[dict[str, Any]]:
    """This process's flight-recorder entries (oldest first); [] when it is off (TORCH_FR_BUFFER_SIZE=0)."""
    from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]  # missing from torch's stubs

    return pickle.loads(_dump_fr_trace(includeStackTraces=False)).get("entries", [])


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


class HangWatch:
    """One per rank, from the process group's start to teardown (see the module docstring)."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, timeout: timedelta, groups: dict[str, str]
    ) -> None:
        self.store, self.rank, self.world_size, self.groups = store, rank, world_size, groups
        self.timeout = timeout.total_seconds()
        self.poll = min(5.0, max(0.5, self.timeout / 6))  # the report reaches every rank within a poll
        self.started: dict[str, int] = {}  # group name -> collectives this rank has started on it
        self.entries: dict[tuple[str, int], dict[str, Any]] = {}  # (group, seq) -> this rank's recent entries
        self._raising = False  # the main thread is raising the report (on_exception)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lit_mesh.HangWatch", daemon=True)

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watch; its thread is gone when this returns (no lit-mesh thread outlives fit, validate, test or
        predict: Lightning's own test conftest fails a test that leaves one). The thread wakes at once from its
        wait; the bound only covers a store call in flight when the peers are gone."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll + 5)

    # ---- every rank's progress, asked for only when a collective timed out (a dump costs ~0.5 s of CPU) -------

    def _refresh(self) -> None:
        started: dict[str, int] = {}
        entries: dict[tuple[str, int], dict[str, Any]] = {}
        for entry in _flight_recorder():
            if entry.get("is_p2p"):
                continue  # point-to-point sequence numbers are not comparable between ranks
            group, seq = entry["process_group"][0], entry["collective_seq_id"]
            started[group] = max(started.get(group, 0), seq)
            entries[(group, seq)] = entry
        self.started, self.entries = started, entries

    def _answer(self) -> None:
        self._refresh()
        self.store.set(f"{_KEY}/started/{self.rank}", json.dumps(self.started))

    def _ask_everyone(self) -> None:
        self.store.set(f"{_KEY}/request", "1")
        self._answer()
        self._wait_for("started")

    def _wait_for(self, what: str) -> None:
        """Until every other rank has set {_KEY}/{what}/{rank}, or a few polls have passed (a dead rank never will)."""
        deadline = time.monotonic() + 2 * self.poll + 2
        keys = [f"{_KEY}/{what}/{r}" for r in range(self.world_size) if r != self.rank]
        while keys and time.monotonic() < deadline and not self.store.check(keys):
            time.sleep(0.1)

    def _started_by(self, rank: int) -> Optional[dict[str, int]]:
        key = f"{_KEY}/started/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    # ---- the report ----------------------------------------------------------------------------------------

    def diagnose(self) -> Optional[str]:
        """The earliest collective this rank started that some rank of its group did not (None if there is none):
        its mesh dim, operation and the ranks that did not arrive."""
        behind_by_group = {}  # group -> {rank: collectives it started on the group, None: no answer}
        for group, mine in self.started.items():
            counts = {r: self._started_by(r) for r in self._ranks(group) if r != self.rank}
            behind = {
                r: c if c is None else c.get(group, 0) for r, c in counts.items() if c is None or c.get(group, 0) < mine
            }
            if behind:
                behind_by_group[group] = behind
        firsts = [
            self.entries.get((g, min((n for n in b.values() if n is not None), default=0) + 1))
            for g, b in behind_by_group.items()
        ]
        entry = min((e for e in firsts if e is not None), key=lambda e: e["time_created_ns"], default=None)
        if entry is None:
            return None
        group, seq = entry["process_group"][0], entry["collective_seq_id"]
        behind, ranks = behind_by_group[group], self._ranks(group)
        op = str(entry["profiling_name"]).split(":")[-1]
        dim = self.groups.get(group, f"process group {group}")
        late = ", ".join(
            f"{r} (" + ("no answer" if n is None else f"started {n} on it") + ")" for r, n in sorted(behind.items())
        )
        return (
            f"collective {op} (#{seq}) on mesh dim '{dim}' (ranks {ranks}) did not complete within the timeout of"
            f" {self.timeout:g} s: ranks that did not arrive: {late}; ranks {sorted(set(ranks) - set(behind))} waited"
            " in it. Look at what the ranks that did not arrive were doing (a stuck data loader, a rank-dependent"
            " branch that skips a collective, a straggler); a legitimately slower step needs a longer"
            " MeshStrategy(timeout=...)"
        )

    def _ranks(self, group: str) -> list[int]:
        from torch.distributed.distributed_c10d import _world

        pg = next((pg for pg, name in _world.pg_names.items() if name == group), None)
        return sorted(dist.get_process_group_ranks(pg)) if pg is not None else list(range(self.world_size))

    def report(self, message: str) -> str:
        """Publish `message` unless another rank's report came first; return the report every rank shows."""
        return self.store.compare_set(f"{_KEY}/report", "", message).decode()

    def reported(self) -> Optional[str]:
        key = f"{_KEY}/report"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def on_exception(self, error: BaseException) -> None:
        """From the main thread (MeshStrategy.on_exception): torch's collective timeout becomes the named error,
        raised once every rank has seen the report; any other error passes unchanged."""
        if self._stop.is_set():
            return
        report = self.reported()
        if report is None:
            if not _is_timeout(error):
                return
            self._raising = True
            self._ask_everyone()
            message = self.diagnose()
            if message is None:  # every rank started every collective: not a hang of a missing rank
                self._raising = False
                return
            report = self.report(message)
        self._raising = True
        _keep_through_sigterm()
        self._wait_for("seen")  # the store may live in this process (rank 0 without torchrun): let them read it
        self.stop()
        raise CollectiveHangError(report) from error

    def _run(self) -> None:
        answered = False
        try:
            while not self._stop.wait(self.poll):
                report = self.reported()
                if report is not None:
                    self._end(report)
                if not answered and self.store.check([f"{_KEY}/request"]):
                    self._answer()
                    answered = True
        except Exception as error:  # noqa: BLE001 - a broken store (peers gone) must not hide the run's own error
            if not self._stop.is_set():
                print(f"[rank {self.rank}] lit_mesh.HangWatch stopped: {error}", file=sys.stderr, flush=True)

    def _end(self, report: str) -> None:
        self.store.set(f"{_KEY}/seen/{self.rank}", "1")
        if self._raising:  # the main thread raises the same error: end the process only if it does not end
            time.sleep(3 * self.poll + 10)
        else:  # stuck where no error of torch's reaches it (the rank that did not arrive)
            print(f"[rank {self.rank}] {CollectiveHangError.__name__}: {report}", file=sys.stderr, flush=True)
            self._wait_for("seen")
        os._exit(1)


def _keep_through_sigterm() -> None:
    """The rank is ending with the named error. The rank that did not arrive exits once it has seen the report, and
    its launcher (torchrun) then sends SIGTERM here: Lightning's handler would broadcast on the broken group and
    replace the report with "Application timeout caused pair closure". Ignore it; this thread's fallback exit
    (`_end`) and the launcher's SIGKILL still bound the process's life."""
    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def start_hang_watch(views: Any, timeout: Optional[timedelta]) -> Optional[HangWatch]:
    """The rank's HangWatch over the mesh's groups, on the default store (None without a process group)."""
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from torch.distributed.distributed_c10d import _get_default_store

    if not dist.is_initialized():
        return None
    return HangWatch(
        _get_default_store(), dist.get_rank(), dist.get_world_size(), timeout or default_pg_timeout, group_names(views)
    ).start()
