"""The pytest side of worker checks (tests/workers/checks.py): one pytest id per check, one launch per worker.

A test module parametrises one test over `check_names(SCRIPT)` and takes a module-scoped fixture that launches
the worker once with `selected_checks(request)`, the checks this session collected (after -k, --deselect, ...):
`pytest -k NAME` launches the ranks for that one check, and a failing check fails the test that bears its name.
A worker that takes its cases from the test (tests/workers/expect_errors.py) is selected the same way: the test
is parametrised over the case names as `check`, and its fixture hands the worker only `selected_checks(request)`.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import WORKERS, launch


def check_names(script: str) -> list[str]:
    """The checks a worker registers with `@check`, read from its source: collecting runs none of its code."""
    tree = ast.parse((WORKERS / script).read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)
    ]


def selected_checks(request: pytest.FixtureRequest) -> list[str]:
    """The `check` parameters of the collected tests of this module that use the requesting fixture (and, for a
    parametrised fixture, its current parameter), in collection order."""
    names: list[str] = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is not request.module or request.fixturename not in item.fixturenames:
            continue
        if hasattr(request, "param") and params.get(request.fixturename) != request.param:
            continue
        if "check" in params and params["check"] not in names:
            names.append(params["check"])
    return names


@dataclass(frozen=True)
class CheckResults:
    """What every rank of one worker launch wrote: OUT_DIR/rank{r}.json = {check: "ok" or traceback}."""

    out_dir: Path
    world_size: int

    def assert_passed(self, name: str) -> None:
        failures = []
        for rank in range(self.world_size):
            file = self.out_dir / f"rank{rank}.json"
            result = json.loads(file.read_text()).get(name) if file.exists() else None
            if result is None:
                failures.append(
                    f"rank {rank}: check {name!r} did not report (not registered, or the rank stopped before it)"
                )
            elif result != "ok":
                failures.append(f"rank {rank}:\n{result}")
        assert not failures, f"worker check {name!r} failed\n" + "\n".join(failures)


def launch_checks(request: pytest.FixtureRequest, script: str, nproc: int, timeout: float) -> CheckResults:
    """One launch of `script` on `nproc` ranks running the checks this session selected."""
    out = request.getfixturevalue("tmp_path_factory").mktemp(script.removesuffix(".py"))
    proc = launch(nproc, script, str(out), ",".join(selected_checks(request)), timeout=timeout)
    assert proc.returncode == 0, f"{script} on {nproc} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return CheckResults(out, nproc)
