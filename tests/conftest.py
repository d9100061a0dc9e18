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
