"""Named checks of a worker script, one pytest id each (the pytest side is tests/worker_checks.py).

A worker registers its checks with `check = Checks()` and `@check` on each function (the check's name is the
function's name), then, on every rank, runs the checks the test session selected and writes what each gave:

    python tests/workers/NAME.py OUT_DIR CHECK[,CHECK...]     -> OUT_DIR/rank{r}.json: {check: "ok" or traceback}

Every rank runs the same checks in the same order (registration order), so their collectives stay in step.

`assert_close_reduction` is the tolerance of every comparison of a sum computed in two orders (a sharded matmul
against nn.Linear, a collective against a local sum).
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch


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


def reduction_atol(reference: torch.Tensor, terms: int, c: float = 4.0) -> float:
    """The absolute tolerance of a result whose every element sums `terms` products, computed in another order (or
    in other pieces, across ranks) than `reference`: atol = c * eps(dtype) * sqrt(terms) * max|reference|.

    Why not a fixed atol (1e-6): the order of a sum decides its rounding, and even with the same seeded inputs the
    order can change from run to run (a CPU BLAS picks its blocking by the memory alignment of its operands). The
    rounding error of a sum grows like sqrt(terms) roundings (a random walk) of the size of its terms, not of the
    sum: an element that cancels to near zero keeps the error of its large terms. max|reference| bounds the size of
    the terms from above (a sum of K terms of size t is ~sqrt(K) t), so the bound holds on every element; c = 4
    covers both sides' rounding with a margin. Fixed 1e-6 failed 1 of 384 gradient elements (1.8e-6 off on an
    element of 1.2e-3, terms ~1) in tests/workers/tp_grid.py; this atol is 3.6e-5 there, while a wrong result
    (one element 1e-4 relative off at the scale of the tensor, a transpose) exceeds it (tests/unit/test_reduction_tolerance.py).
    """
    return c * torch.finfo(reference.dtype).eps * math.sqrt(terms) * reference.detach().abs().max().item()


def assert_close_reduction(actual: torch.Tensor, expected: torch.Tensor, terms: int, c: float = 4.0, msg: str | None = None) -> None:
    """torch.testing.assert_close with reduction_atol(expected, terms) and no relative part: the error of a sum does
    not scale with the element's own size."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=reduction_atol(expected, terms, c), msg=msg)
