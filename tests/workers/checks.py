"""Named checks of a worker script, one pytest id each (the pytest side is tests/worker_checks.py).

A worker registers its checks with `check = Checks()` and `@check` on each function (the check's name is the
function's name), then, on every rank, runs the checks the test session selected and writes what each gave:

    python tests/workers/NAME.py OUT_DIR CHECK[,CHECK...]     -> OUT_DIR/rank{r}.json: {check: "ok" or traceback}

Every rank runs the same checks in the same order (registration order), so their collectives stay in step.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


class Checks:
    """The registry of one worker's checks."""

    def __init__(self) -> None:
        self.functions: dict[str, Callable[[], object]] = {}
        self.results: dict[str, str] = {}

    def __call__(self, function: Callable[[], object]) -> Callable[[], object]:
        self.functions[function.__name__] = function
        return function

    def run(self, selected: list[str]) -> None:
        """Run the selected checks that are registered, in registration order; a failure does not stop the others."""
        for name, function in self.functions.items():
            if name in selected:
                try:
                    function()
                    self.results[name] = "ok"
                except Exception:  # noqa: BLE001 - recorded for the test that names this check
                    self.results[name] = traceback.format_exc()[-3000:]

    def write(self, out_dir: Path, rank: int) -> None:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(self.results))

    def run_on_gloo(self, out_dir: Path, selected: list[str]) -> None:
        """A worker's whole main: the selected checks on a gloo process group, each rank's results written, then
        exit without Python's teardown."""
        import torch.distributed as dist

        from tests.workers import exit_skipping_teardown

        dist.init_process_group("gloo")
        self.run(selected)
        self.write(out_dir, dist.get_rank())
        exit_skipping_teardown()


def arguments() -> tuple[Path, list[str]]:
    """OUT_DIR and the selected check names from the command line."""
    return Path(sys.argv[1]), [name for name in sys.argv[2].split(",") if name]
