"""The documentation site builds with no broken link or reference (`mkdocs build --strict`, as CI would publish
it), and every Python example of its pages runs (tests/docs_examples.py: skipped blocks are compiled and must say
why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_examples import examples_of, run_page
from tests.launch import REPO

PAGES = sorted((REPO / "docs").rglob("*.md"))


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = tmp_path / "site"
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "<table>" in benchmarks and "rendered by benchmarks/report.py" not in benchmarks  # the hook rendered it
    assert (site / "benchmarks" / "figures" / "loss_curves.png").is_file()
    api = (site / "api" / "index.html").read_text()
    assert 'id="lit_mesh.strategy.MeshStrategy"' in api
    assert "FSDP shards per replica" in api  # the Args section composed from the options at import (dp_shard's help)


def test_the_docs_have_examples_that_run() -> None:
    runnable = [e for page in PAGES for e in examples_of(page) if not e.skip]
    assert len(runnable) >= 10, [f"{e.page.name}:{e.line}" for e in runnable]


@pytest.mark.parametrize("page", [p for p in PAGES if examples_of(p)], ids=lambda p: p.relative_to(REPO).as_posix())
def test_examples_of_the_page_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # an example that writes (logs, checkpoints) writes here
    run_page(page)
