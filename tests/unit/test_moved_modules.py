"""Moved modules keep their old paths for one release (lit_mesh/registration.py, MOVED_MODULES): the old path
imports the new module itself, with a DeprecationWarning that names the new path and points at the importing line.

pyproject's filterwarnings ignores DeprecationWarning in tests, so every check here records warnings itself.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

import pytest

import lit_mesh
from lit_mesh.registration import MOVED_MODULES, moved_to

MOVES = sorted(MOVED_MODULES.items())


def _forget(old: str) -> None:
    """Make the next import of `old` go through the import hook again (it warns once per process)."""
    sys.modules.pop(old, None)
    parent, _, child = old.rpartition(".")
    if parent in sys.modules:
        sys.modules[parent].__dict__.pop(child, None)


def _moved_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, DeprecationWarning) and " moved to " in str(w.message)]


@pytest.fixture
def recorded() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


@pytest.mark.parametrize(("old", "new"), MOVES, ids=[old for old, _ in MOVES])
def test_old_path_imports_the_new_module_and_warns(old: str, new: str, recorded: list) -> None:
    _forget(old)
    module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is module
    assert module.__name__ == new and module.__spec__ is not None and module.__spec__.name == new
    (warning,) = _moved_warnings(recorded)
    assert f"{old} moved to {new}" in str(warning.message)
    assert warning.filename == __file__, f"the warning should name the importing line, not {warning.filename}"


def test_import_statements_through_old_paths_give_the_same_objects(recorded: list) -> None:
    for old in ("lit_mesh.faults", "lit_mesh.hangs", "lit_mesh.topology"):
        _forget(old)
    import lit_mesh.hangs
    from lit_mesh.faults import FaultInjector
    from lit_mesh.reliability import faults, hangs

    assert lit_mesh.hangs is hangs and FaultInjector is faults.FaultInjector is lit_mesh.FaultInjector
    assert lit_mesh.faults.FaultInjector is lit_mesh.reliability.faults.FaultInjector
    from lit_mesh import topology

    assert topology.Topology is lit_mesh.Topology
    warned = [str(w.message).split(" moved")[0] for w in _moved_warnings(recorded)]
    assert warned == ["lit_mesh.hangs", "lit_mesh.faults", "lit_mesh.topology"]
    assert {w.filename for w in _moved_warnings(recorded)} == {__file__}


def test_the_new_paths_import_without_a_warning(recorded: list) -> None:
    for new in MOVED_MODULES.values():
        importlib.import_module(new)
    assert not _moved_warnings(recorded)


def test_the_table_maps_to_modules_outside_the_old_paths() -> None:
    """A new path under an old one would import itself through the hook without end; an old path that still
    exists as a file would be shadowed by the hook (move it, or drop the alias)."""
    for old, new in MOVED_MODULES.items():
        assert not new.startswith(old + "."), f"{new} lies under the old path {old}"
        assert moved_to(new) is None, f"{new} is itself an old path"
        assert old != new


def test_modules_under_an_old_package_path_are_found_too(monkeypatch: pytest.MonkeyPatch, recorded: list) -> None:
    monkeypatch.setitem(MOVED_MODULES, "lit_mesh.old_training", "lit_mesh.training")
    for name in ("lit_mesh.old_training", "lit_mesh.old_training.grad_norm"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from lit_mesh.old_training.grad_norm import clip_grad_norm_
    from lit_mesh.training import grad_norm

    assert clip_grad_norm_ is grad_norm.clip_grad_norm_
    assert sys.modules["lit_mesh.old_training.grad_norm"] is grad_norm
    for name in ("lit_mesh.old_training", "lit_mesh.old_training.grad_norm"):
        sys.modules.pop(name, None)
    lit_mesh.__dict__.pop("old_training", None)


def test_unknown_modules_are_still_unknown() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lit_mesh.no_such_module")
    with pytest.raises(ModuleNotFoundError, match="is not a package"):
        importlib.import_module("lit_mesh.faults.no_such_module")


def test_the_checkpoint_package_keeps_the_old_module_names_without_a_warning(recorded: list) -> None:
    """lit_mesh/checkpoint.py became the package lit_mesh.checkpoint: its names are re-exported, nothing warns."""
    import lit_mesh.checkpoint as package
    from lit_mesh.checkpoint import export, files

    exported = ["export_full_state_dict", "load_full_state_dict"]
    old_names = (
        exported
        + (
            "NESTED_OPTIMIZER_STATE_OPTIONS OPTIMIZER_STATE_OPTIONS CheckpointError NotACheckpointError dcp_load"
            " dcp_writable failed_save_reported load_sharded_checkpoint model_problems optimizer_state_options"
            " publish_checkpoint refuse_overwriting_other_files remove_checkpoint shard_problems"
            " stored_optimizer_state_options verify_checkpoint"
        ).split()
    )
    for name in old_names:
        home: ModuleType = export if name in exported else files
        assert getattr(package, name) is getattr(home, name), name
    assert sorted(package.__all__) == sorted(old_names)
    assert not _moved_warnings(recorded)


def test_a_yaml_class_path_through_an_old_path_resolves(recorded: list) -> None:
    """LightningCLI reads `class_path`s with jsonargparse, which imports the module part of the path."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.callbacks import Callback

    from lit_mesh.reliability.faults import FaultInjector
    from lit_mesh.reliability.preemption import Preemption

    for old in ("lit_mesh.faults", "lit_mesh.preemption"):
        _forget(old)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--callbacks", type=list[Callback])
    config = parser.parse_string(
        "callbacks:\n"
        "  - class_path: lit_mesh.faults.FaultInjector\n"
        "    init_args: {fault: kill, step: 3}\n"
        "  - class_path: lit_mesh.preemption.Preemption\n"
    )
    injector, preemption = parser.instantiate_classes(config).callbacks
    assert type(injector) is FaultInjector and injector.step == 3
    assert type(preemption) is Preemption
    warned = {str(w.message).split(" moved")[0] for w in _moved_warnings(recorded)}
    assert warned == {"lit_mesh.faults", "lit_mesh.preemption"}
