"""Named checks of a worker script, one pytest id each (the pytest side is tests/worker_checks.py).

A worker registers its checks with `check = Checks()` and `@check` on each function (the check's name is the
function's name), then, on every rank, runs the checks the test session selected and writes what each gave:

    python tests/workers/NAME.py OUT_DIR CHECK[,CHECK...]     -> OUT_DIR/rank{r}.json: {check: "ok" or traceback}

Every rank runs the same checks in the same order (registration order), so their collectives stay in step.

`assert_close_reduced` is the tolerance of every comparison of a sum computed in two orders (a sharded matmul
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


def reduction_atol(reference: torch.Tensor, reduced: int, c: float = 8.0) -> float:
    """The absolute tolerance for a tensor computed as sums of `reduced` terms, each sum in another order than the
    reference's (split over ranks, or another kernel's blocking), in the reference's floating dtype.

    atol = c * eps(dtype) * sqrt(reduced) * max|reference|: rounding errors of a sum of K terms grow like
    sqrt(K) * eps times the terms' size (a random walk of last-bit errors), and max|reference| is that size's scale.
    Scaled by the largest element, not each element's own value, because a near-zero element of a sum (the terms
    cancelling) carries the rounding error of its large terms: a fixed tiny atol with an rtol flakes on exactly
    those. c = 8 leaves room for the worst draw; a real bug (a missing or doubled partial sum, a wrong block) is
    off by the values' own scale, orders of magnitude above (tests/unit/test_worker_checks.py shows a 1e-4 relative
    change of one element fails)."""
    dtype = reference.dtype if reference.is_floating_point() else torch.float32
    return c * torch.finfo(dtype).eps * math.sqrt(max(reduced, 1)) * reference.detach().abs().max().item()


def assert_close_reduced(
    actual: torch.Tensor, reference: torch.Tensor, reduced: int, *, c: float = 8.0, msg: str | None = None
) -> None:
    """assert_close with reduction_atol (and no rtol: the atol is already scaled to the values); `msg` prefixes
    torch's own message."""
    atol = reduction_atol(reference, reduced, c)
    torch.testing.assert_close(actual, reference, rtol=0, atol=atol, msg=lambda text: f"{msg or 'tensors'}: {text}")


def arguments() -> tuple[Path, list[str]]:
    """OUT_DIR and the selected check names from the command line."""
    return Path(sys.argv[1]), [name for name in sys.argv[2].split(",") if name]
