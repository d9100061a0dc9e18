"""The files and tests that the documentation names exist: every `lit_mesh/...`, `zoo/...`, `tests/...`,
`benchmarks/...`, `examples/...` or `configs/...` path in README.md, ARCHITECTURE.md and docs/*.md, and every
`tests/...py::test_name` (a `*` in the name matches as a glob) names a test function of that file. A moved or renamed
file or test then fails here instead of leaving the docs pointing at nothing."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

import pytest

from tests.launch import REPO

DOCS = [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs").rglob("*.md"))]
# a link target, `](...)`, is relative to its page and checked by `mkdocs build --strict` (tests/integration/test_docs.py)
PATH = re.compile(
    r"(?<![\w./-])(?<!\]\()((?:lit_mesh|zoo|tests|benchmarks|examples|configs)/[\w./-]*\w/?)(?:::([\w*]+))?"
)


def named_paths(doc: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2) or "") for m in PATH.finditer(doc.read_text())]


def functions_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_paths_a_page_names_exist(doc: Path) -> None:
    named = named_paths(doc)
    missing = sorted({path for path, _ in named if not (REPO / path).exists()})
    assert not missing, f"{doc.name} names files that do not exist: {missing}"
    for path, test in named:
        if test:
            functions = functions_of(REPO / path)
            assert fnmatch.filter(functions, test), f"{doc.name}: {path} has no function {test!r}"


def test_the_architecture_paths_are_checked() -> None:
    # the pattern reads the map: if it stopped matching, the test above would pass on nothing
    assert len(named_paths(REPO / "ARCHITECTURE.md")) >= 10
    assert len(named_paths(REPO / "docs" / "techniques" / "pipeline-parallel.md")) >= 5


def test_the_architecture_claims_match_its_test() -> None:
    """ARCHITECTURE.md's numbers and exceptions are those tests/unit/test_architecture.py enforces."""
    from tests.unit import test_architecture

    text = " ".join((REPO / "ARCHITECTURE.md").read_text().split())
    says_empty = "(`KNOWN_EXCEPTIONS`) is empty" in text
    assert says_empty == (not test_architecture.KNOWN_EXCEPTIONS), "ARCHITECTURE.md and KNOWN_EXCEPTIONS disagree"
    at_most = re.search(r"At most (\d+) modules sit at the root of `lit_mesh/`", text)
    assert at_most, "ARCHITECTURE.md no longer states the root-module limit"
    source = (REPO / "tests" / "unit" / "test_architecture.py").read_text()
    assert f"assert len(root) <= {at_most.group(1)}," in source
