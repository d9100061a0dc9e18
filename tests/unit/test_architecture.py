"""The one direction of dependencies (ARCHITECTURE.md): zoo/models -> plan -> parallel -> strategy, and no import
cycle, read from the import statements of lit_mesh/ and zoo/ with `ast` (nothing is imported)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.launch import REPO

# (room: the files a path prefix names, what it must not import, why)
RULES = [
    ("lit_mesh/", ("zoo",), "the library never depends on the example models"),
    ("lit_mesh/", ("lit_mesh.strategy", "lit_mesh.cli"), "only the package's front door re-exports the adapter"),
    (
        "lit_mesh/plan.py",
        ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
        "a plan is data: it names what to parallelise, never how",
    ),
    (
        "lit_mesh/init.py",
        ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
        "initialisation rules are declared by models, below the techniques",
    ),
    (
        "lit_mesh/mesh.py",
        ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
        "the mesh is the vocabulary every technique uses",
    ),
    (
        "lit_mesh/unit.py",
        ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.mesh", "lit_mesh.rules", "lit_mesh.options"),
        "every unit declares its rules and options with it, so it depends on none of them",
    ),
    (
        "lit_mesh/parallel/",
        ("lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
        "techniques apply plans; they do not know which models declare them",
    ),
    (
        "lit_mesh/comm/",
        ("lit_mesh.parallel", "lit_mesh.hf", "lit_mesh.monitor", "lit_mesh.planner"),
        "communication is below the techniques that call it",
    ),
    (
        "lit_mesh/checkpoint/",
        (
            "lit_mesh.parallel",
            "lit_mesh.reliability",
            "lit_mesh.training",
            "lit_mesh.hf",
            "lit_mesh.monitor",
            "lit_mesh.planner",
        ),
        "checkpoints store and load state; they do not know the techniques that sharded it",
    ),
    (
        "lit_mesh/reliability/",
        (
            "lit_mesh.parallel",
            "lit_mesh.comm",
            "lit_mesh.checkpoint",
            "lit_mesh.training",
            "lit_mesh.hf",
            "lit_mesh.monitor",
            "lit_mesh.planner",
        ),
        "a run's safety nets watch processes and steps, not the techniques",
    ),
    (
        "lit_mesh/training/",
        (
            "lit_mesh.parallel",
            "lit_mesh.comm",
            "lit_mesh.checkpoint",
            "lit_mesh.reliability",
            "lit_mesh.hf",
            "lit_mesh.monitor",
            "lit_mesh.planner",
        ),
        "helpers of Lightning's loop work on any sharded model",
    ),
    (
        "zoo/gpt.py",
        ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.mesh", "lit_mesh.hf"),
        "models know nothing of meshes",
    ),
    (
        "zoo/moe.py",
        ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.mesh", "lit_mesh.hf"),
        "models know nothing of meshes",
    ),
    (
        "zoo/vit.py",
        ("lit_mesh.parallel", "lit_mesh.comm", "lit_mesh.mesh", "lit_mesh.hf"),
        "models know nothing of meshes",
    ),
]
# the public API (`from lit_mesh import MeshStrategy`), and the registration of strategy="mesh" that import
# lit_mesh arranges (lit_mesh/registration.py)
EXEMPT = {
    "lit_mesh/__init__.py": ("lit_mesh.strategy",),
    "lit_mesh/registration.py": ("lit_mesh.strategy",),
}  # the public API: `from lit_mesh import MeshStrategy`

# Exceptions, (file, imported package): none. The planner and the command reach the zoo's models through the model
# family registry (lit_mesh/planner/families.py) that zoo registers into. An entry that no longer occurs fails
# test_known_exceptions_still_occur, so the list cannot outlive an exception.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's syntax tree, parsed once for every test of this module (the tree is read-only here)."""
    return ast.parse(path.read_text())


def imports_of(path: Path) -> set[str]:
    """The modules a file imports (absolute imports: lit_mesh and zoo use no relative ones)."""
    found: set[str] = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import of {node.module}: use the absolute name"
            found.add(node.module)
    return found


def is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@functools.cache
def violations() -> frozenset[tuple[str, str, str]]:
    """(file, imported module, the rule's reason) for every import a rule forbids."""
    found = set()
    for path in sorted([*(REPO / "lit_mesh").rglob("*.py"), *(REPO / "zoo").rglob("*.py")]):
        name = path.relative_to(REPO).as_posix()
        for module in imports_of(path):
            for room, forbidden, why in RULES:
                if name.startswith(room) and any(is_under(module, f) for f in forbidden):
                    if not any(is_under(module, e) for e in EXEMPT.get(name, ())):
                        found.add((name, module, why))
    return frozenset(found)


def is_known(file: str, module: str) -> bool:
    return any(file == f and is_under(module, package) for f, package in KNOWN_EXCEPTIONS)


def test_dependencies_point_one_way() -> None:
    unexpected = sorted((f, m, why) for f, m, why in violations() if not is_known(f, m))
    assert not unexpected, "imports against the direction of ARCHITECTURE.md:\n" + "\n".join(
        f"{f} imports {m}: {why}" for f, m, why in unexpected
    )


def test_known_exceptions_still_occur() -> None:
    found = violations()
    gone = {
        (f, package) for f, package in KNOWN_EXCEPTIONS if not any(f == g and is_under(m, package) for g, m, _ in found)
    }
    assert not gone, f"no longer imported, remove from KNOWN_EXCEPTIONS: {sorted(gone)}"


@pytest.mark.parametrize("room", sorted({room for room, _, _ in RULES}))
def test_every_room_of_a_rule_exists(room: str) -> None:
    assert (REPO / room).exists(), f"{room} moved: update RULES (and ARCHITECTURE.md)"


# mesh.py is pure: degrees -> layout -> DeviceMesh, with the vocabulary of rules and options (lit_mesh.unit)
MESH_MAY_IMPORT = ("lit_mesh.errors", "lit_mesh.unit")


def test_mesh_imports_only_errors_and_unit() -> None:
    ours = {m for m in imports_of(REPO / "lit_mesh/mesh.py") if is_under(m, "lit_mesh")}
    assert ours <= set(MESH_MAY_IMPORT), f"lit_mesh/mesh.py imports {sorted(ours - set(MESH_MAY_IMPORT))}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at module level or inside functions, except under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of lit_mesh/ and zoo/ it imports (`from package import module` names the module)."""
    paths = sorted([*(REPO / "lit_mesh").rglob("*.py"), *(REPO / "zoo").rglob("*.py")])
    modules = {_module_name(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in _runtime_imports(parsed(path)):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif node.module in modules or any(f"{node.module}.{alias.name}" in modules for alias in node.names):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    edges.add(target if target in modules else node.module)
        graph[name] = edges - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(cycles)


def test_import_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
    tree = ast.parse(
        "import os\nif TYPE_CHECKING:\n    import lit_mesh.init\ndef f():\n    from lit_mesh import mesh\n"
    )
    assert [ast.unparse(node) for node in _runtime_imports(tree)] == ["import os", "from lit_mesh import mesh"]


def test_no_import_cycles() -> None:
    """No module of lit_mesh/ or zoo/ reaches itself through its imports (deferred imports inside functions count:
    they hide a cycle, they do not remove it; imports only for type checkers do not)."""
    graph = import_graph()

    def path_back(cycle: list[str]) -> str:  # one loop through the component, to name in the message
        members, start = set(cycle), cycle[0]
        seen, frontier = {start: [start]}, [start]
        while frontier:
            node = frontier.pop(0)
            for target in sorted(graph[node] & members):
                if target == start:
                    return " -> ".join([*seen[node], start])
                if target not in seen:
                    seen[target] = [*seen[node], target]
                    frontier.append(target)
        return ", ".join(cycle)

    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(path_back(cycle) for cycle in cycles)


def _where_to_look() -> dict[str, list[str]]:
    """ARCHITECTURE.md's "Where to look": each question -> the lit_mesh files its answer names, in order."""
    text = (REPO / "ARCHITECTURE.md").read_text().split("## Where to look", 1)[1].split("\n## ", 1)[0]
    answers: dict[str, list[str]] = {}
    for item in text.split("\n- ")[1:]:
        question, answer = item.split("?", 1)
        answers[question.strip(" -\n")] = list(dict.fromkeys(re.findall(r"`(lit_mesh/[\w/.]+\.py)`", answer)))
    return answers


@pytest.mark.parametrize("question", ["Where is tensor parallel applied", "How does a batch reach the pipeline stages"])
def test_the_map_answers_in_at_most_three_files_that_exist(question: str) -> None:
    """The issue-#39 promise: a maintainer finds a technique in at most 3 files, and the map's answer stays true."""
    files = _where_to_look()[question]
    assert 1 <= len(files) <= 3, f"{question}? names {files}: at most 3 files"
    missing = [f for f in files if not (REPO / f).is_file()]
    assert not missing, f"ARCHITECTURE.md names files that do not exist: {missing}"


def test_the_root_of_the_package_stays_small() -> None:
    root = sorted(p.name for p in (REPO / "lit_mesh").glob("*.py"))
    assert len(root) <= 15, f"{len(root)} modules at the root of lit_mesh/ (at most 15): {root}"
