"""Every test module starts as if it ran first in its process: no process group and no launcher variables left by
an earlier module (in-process tests start fake or gloo groups, and Lightning's environment writes MASTER_PORT).
The suite runs modules on two pytest-xdist workers, in an order that changes with the split."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from lit_mesh.cli import close_process_groups


@pytest.fixture(autouse=True, scope="module")
def _module_starts_clean() -> Iterator[None]:
    environment = dict(os.environ)
    close_process_groups()
    yield
    close_process_groups()
    os.environ.clear()
    os.environ.update(environment)


# The slowest modules first (seconds measured on 2 cores, `--durations`), so that the two workers end on the small
# unit modules together rather than one waiting on a late multi-rank module; xdist's own reordering is off in
# pyproject.toml (`--no-loadscope-reorder`: it would start the modules with the most tests first).
SLOWEST_MODULES = (
    "tests/integration/test_parity.py",
    "tests/integration/test_pipeline.py",
    "tests/integration/test_parity_8rank.py",
    "tests/integration/test_hf.py",
    "tests/integration/test_compression_training.py",
    "tests/integration/test_resume.py",
    "tests/integration/test_moe_parity.py",
    "tests/integration/test_reshard.py",
    "tests/integration/test_planner_search.py",
    "tests/integration/test_examples.py",
    "tests/integration/test_topology.py",
    "tests/integration/test_context_parallel.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Integration modules before unit modules, the slowest listed first; a module's tests keep their order."""

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::")[0]
        if path in SLOWEST_MODULES:
            return (0, SLOWEST_MODULES.index(path))
        return (1 if path.startswith("tests/integration/") else 2, 0)

    items.sort(key=rank)  # stable: within a module, and among unlisted modules, collection order stays
