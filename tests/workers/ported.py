"""The loop of the workers that run tests ported from Lightning (model_parallel_compat.py, fsdp_compat.py): each
scenario in a directory of its own, under Lightning's zombie-thread check, its outcome recorded for the test."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from tests.thread_police import no_zombie_threads


def run_scenarios(scenarios: Iterable[Callable[[Path], Any]], out: Path, only: set[str] | None) -> None:
    """Run every scenario (those in `only` when given) and write {name: {"ok", "value" | "error"}} to
    out/rank{r}.json after each, so a launch stopped later still reports what ran."""
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for scenario in scenarios:
        if only and scenario.__name__ not in only:
            continue
        tmp = out / scenario.__name__
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            with no_zombie_threads():  # Lightning's conftest check, around every test it ports
                value = scenario(tmp)
            results[scenario.__name__] = {"ok": True, "value": value}
        except BaseException:  # noqa: BLE001 - DCP raises BaseException subclasses; recorded for the test to show
            results[scenario.__name__] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
