"""The static checks CI runs with the suite, each as a subprocess from the repository root with the configuration in
pyproject.toml, failing with its report: the linter and the formatter (ruff, [tool.ruff]: the whole repository) and
the type checker (mypy, [tool.mypy]: lit_mesh/)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.launch import REPO


def _run(tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (the `test` extra brings it: pip install -e '.[test]')")
    # a cold mypy cache (.mypy_cache in the repository) takes about a minute; a warm one seconds
    return subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=REPO, capture_output=True, text=True, timeout=540, check=False
    )


def test_mypy_passes() -> None:
    result = _run("mypy", "--config-file", "pyproject.toml")
    if result.returncode != 0:
        pytest.fail(f"mypy (pyproject.toml [tool.mypy]) reports:\n{result.stdout}{result.stderr}", pytrace=False)


def test_ruff_lint_passes() -> None:
    result = _run("ruff", "check", ".")
    if result.returncode != 0:
        pytest.fail(
            f"ruff check (pyproject.toml [tool.ruff.lint]) reports:\n{result.stdout}{result.stderr}", pytrace=False
        )


def test_ruff_format_is_applied() -> None:
    result = _run("ruff", "format", "--check", ".")
    if result.returncode != 0:
        pytest.fail(f"ruff format --check: run `ruff format .`:\n{result.stdout}{result.stderr}", pytrace=False)
