"""The one direction of dependencies (ARCHITECTURE.md): zoo/models -> plan -> parallel -> strategy, read from the
import statements of lit_mesh/ and zoo/ with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.launch import REPO

# (room: the files a path prefix names, what it must not import, why)
RULES = [
    ("lit_mesh/", ("zoo",), "the library never depends on the example models"),
    ("lit_mesh/", ("lit_mesh.strategy", "lit_mesh.cli"), "only the package's front door re-exports the adapter"),
    ("lit_mesh/plan.py", ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
     "a plan is data: it names what to parallelise, never how"),
    ("lit_mesh/init.py", ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
     "initialisation rules are declared by models, below the techniques"),
    ("lit_mesh/mesh.py", ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
     "the mesh is the vocabulary every technique uses"),
    ("lit_mesh/parallel/", ("lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
     "techniques apply plans; they do not know which models declare them"),
    ("lit_mesh/comm/", ("lit_mesh.parallel", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
     "communication is below the techniques that call it"),
    ("zoo/gpt.py", ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.mesh", "lit_mesh.hf"), "models know nothing of meshes"),
    ("zoo/moe.py", ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.mesh", "lit_mesh.hf"), "models know nothing of meshes"),
    ("zoo/vit.py", ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.mesh", "lit_mesh.hf"), "models know nothing of meshes"),
]  # fmt: skip
# the public API (`from lit_mesh import MeshStrategy`), and the registration of strategy="mesh" that import
# lit_mesh arranges (lit_mesh/registration.py)
EXEMPT = {"lit_mesh/__init__.py": ("lit_mesh.strategy",), "lit_mesh/registration.py": ("lit_mesh.strategy",)}  # the public API: `from lit_mesh import MeshStrategy`

# Exceptions, (file, imported package): none. The planner and the command reach the zoo's models through the model
# family registry (lit_mesh/planner/families.py) that zoo registers into. An entry that no longer occurs fails
# test_known_exceptions_still_occur, so the list cannot outlive an exception.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def imports_of(path: Path) -> set[str]:
    """The modules a file imports (absolute imports: lit_mesh and zoo use no relative ones)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import of {node.module}: use the absolute name"
            found.add(node.module)
    return found


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations() -> set[tuple[str, str, str]]:
    """(file, imported module, the rule's reason) for every import a rule forbids."""
    found = set()
    for path in sorted([*(REPO / "lit_mesh").rglob("*.py"), *(REPO / "zoo").rglob("*.py")]):
        name = path.relative_to(REPO).as_posix()
        for module in imports_of(path):
            for room, forbidden, why in RULES:
                if name.startswith(room) and any(is_under(module, f) for f in forbidden):
                    if not any(is_under(module, e) for e in EXEMPT.get(name, ())):
                        found.add((name, module, why))
    return found


def is_known(file: str, module: str) -> bool:
    return any(file == f and is_under(module, package) for f, package in KNOWN_EXCEPTIONS)


def test_dependencies_point_one_way() -> None:
    unexpected = sorted((f, m, why) for f, m, why in violations() if not is_known(f, m))
    assert not unexpected, "imports against the direction of ARCHITECTURE.md:\n" + "\n".join(
        f"{f} imports {m}: {why}" for f, m, why in unexpected
    )


def test_known_exceptions_still_occur() -> None:
    found = violations()
    gone = {(f, package) for f, package in KNOWN_EXCEPTIONS if not any(f == g and is_under(m, package) for g, m, _ in found)}
    assert not gone, f"no longer imported, remove from KNOWN_EXCEPTIONS: {sorted(gone)}"


@pytest.mark.parametrize("room", sorted({room for room, _, _ in RULES}))
def test_every_room_of_a_rule_exists(room: str) -> None:
    assert (REPO / room).exists(), f"{room} moved: update RULES (and ARCHITECTURE.md)"
