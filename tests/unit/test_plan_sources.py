"""Plans and initialisation reach parallel/apply.py and init.py through registries, never by importing upward."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import lit_mesh
from lit_mesh import init as init_module
from lit_mesh import plan as plan_module
from lit_mesh.init import materialize, register_initialiser
from lit_mesh.parallel.apply import find_plan_owners
from lit_mesh.parallel.tensor import PlanError
from lit_mesh.plan import ParallelPlan, PlanOwner, register_plan_source

ROOT = Path(lit_mesh.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    "path", [ROOT / "plan.py", ROOT / "init.py", *sorted((ROOT / "parallel").glob("*.py"))], ids=str
)
def test_lower_layers_import_neither_hf_nor_zoo(path: Path) -> None:
    upward = {name for name in _imports(path) if name.startswith(("lit_mesh.hf", "zoo"))}
    assert not upward, (
        f"{path.relative_to(ROOT.parent)} imports {upward}; register through lit_mesh.plan / lit_mesh.init"
    )


class Tower(nn.Module):
    """A model of a foreign library: no parallel_plan() method of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


class Declares(Tower):
    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(blocks="layers")


@pytest.fixture
def registries():
    sources, initialisers = list(plan_module._PLAN_SOURCES), list(init_module._INITIALISERS)
    yield
    plan_module._PLAN_SOURCES[:] = sources
    init_module._INITIALISERS[:] = initialisers


def test_a_registered_plan_source_gives_plans_to_modules_without_their_own(registries) -> None:
    root = nn.Module()
    root.foreign, root.own = Tower(), Declares()
    assert [o.name for o in find_plan_owners(root)] == ["own"]
    from_source = ParallelPlan(blocks="layers", init=(("*", lit_mesh.Init("zeros")),))
    register_plan_source(lambda m: (lambda: from_source) if type(m) is Tower else None)
    register_plan_source(lambda m: pytest.fail("a later source is asked only when the earlier ones do not know m"))
    owners = {o.name: o.plan for o in find_plan_owners(root)}
    assert owners["foreign"] is from_source and owners["own"] == Declares().parallel_plan()


def test_a_registered_initialiser_initialises_owners_without_init_rules(registries) -> None:
    with torch.device("meta"):
        model = Tower()
    owners = [PlanOwner("", model, ParallelPlan(blocks="layers"))]

    def fill_ones(module: nn.Module, skip: object) -> bool:
        if not isinstance(module, Tower):
            return False
        for p in module.parameters():
            p.fill_(1.0)
        return True

    register_initialiser(fill_ones)
    materialize(model, owners, torch.device("cpu"))
    assert all(bool((p == 1).all()) for p in model.parameters())


def test_modules_without_any_initialisation_are_refused() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(
        PlanError,
        match=r"modules \[\"Bare \(built on the meta device.*hold meta-device weights but have no reset_parameters",
    ):
        materialize(model, [], torch.device("cpu"))


@pytest.mark.parametrize("old_name", ["vocab_embedding", "gather_hidden_states", "shard_hidden_states"])
def test_a_style_outside_the_vocabulary_is_refused_by_name(old_name: str) -> None:
    with pytest.raises(ValueError, match=f"module 'embed' has TP style '{old_name}'; choose one of"):
        lit_mesh.TensorPlan(root={"embed": old_name})
