"""The README's two commands are the ones that work: CI runs the README's test command verbatim."""

from __future__ import annotations

from tests.launch import REPO


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in readme
    assert "pip install torch==2.13.0 -e . && lit-mesh fit -c configs/quickstart.yaml" in readme
    assert (REPO / "configs" / "quickstart.yaml").exists()
