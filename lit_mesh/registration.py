"""What `import lit_mesh` arranges, without importing torch or Lightning: `Trainer(strategy="mesh")` works, and
the old paths of moved modules still import (with a DeprecationWarning) for one release.

Lightning's StrategyRegistry lives in lightning.pytorch.strategies, whose import costs seconds (torch, Lightning):
too much for `lit-mesh --help` or `lit-mesh plan`. So: if Lightning is already loaded, "mesh" is registered now;
otherwise a one-shot import hook registers it the moment lightning.pytorch.strategies has finished loading.
Either way the entry builds MeshStrategy on demand (lit_mesh.strategy then re-registers the class itself).

Moved modules: MOVED_MODULES maps each old dotted path to its new one. An import hook answers an old path with the
module object of the new one (`lit_mesh.faults.FaultInjector is lit_mesh.reliability.faults.FaultInjector`), so
imports, YAML `class_path`s and pickles that name the old path keep working; it warns once per process, naming
the new path. Moving a module is one line in the table.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from importlib import import_module
from types import ModuleType
from typing import Any

NAME = "mesh"
DESCRIPTION = "N-D mesh: DDP/FSDP/HSDP x TP/SP from the model's plan"
STRATEGIES_MODULE = "lightning.pytorch.strategies"


def mesh_strategy(**kwargs: Any) -> Any:
    from lit_mesh.strategy import MeshStrategy

    return MeshStrategy(**kwargs)


def _register(strategies: ModuleType) -> None:
    if NAME not in strategies.StrategyRegistry:  # lit_mesh.strategy, once imported, registers the class itself
        strategies.StrategyRegistry.register(NAME, mesh_strategy, description=DESCRIPTION)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of lightning.pytorch.strategies to register after it runs."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != STRATEGIES_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; and the real finders answer the lookup below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _register(module)

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def register_mesh_strategy() -> None:
    if STRATEGIES_MODULE in sys.modules:
        _register(sys.modules[STRATEGIES_MODULE])
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


# old dotted module path -> new one; kept for one release after the move (CHANGELOG.md says which)
MOVED_MODULES: dict[str, str] = {
    "lit_mesh.checkpoint_writer": "lit_mesh.checkpoint.writer",
    "lit_mesh.async_save": "lit_mesh.checkpoint.async_save",
    "lit_mesh.resume": "lit_mesh.checkpoint.resume",
    "lit_mesh.pretrained": "lit_mesh.checkpoint.pretrained",
    "lit_mesh.hangs": "lit_mesh.reliability.hangs",
    "lit_mesh.faults": "lit_mesh.reliability.faults",
    "lit_mesh.preemption": "lit_mesh.reliability.preemption",
    "lit_mesh.elastic": "lit_mesh.reliability.elastic",
    "lit_mesh.replan": "lit_mesh.reliability.replan",
    "lit_mesh.nonfinite": "lit_mesh.reliability.nonfinite",
    "lit_mesh.precision": "lit_mesh.training.precision",
    "lit_mesh.grad_norm": "lit_mesh.training.grad_norm",
    "lit_mesh.progress": "lit_mesh.training.progress",
    "lit_mesh.log_steps": "lit_mesh.training.log_steps",
    "lit_mesh.pipeline_timeline": "lit_mesh.monitor.pipeline_timeline",
    "lit_mesh.parallel.pipeline_split": "lit_mesh.parallel.pipeline.split",
    "lit_mesh.parallel.pipeline_moe": "lit_mesh.parallel.pipeline.moe",
    "lit_mesh.parallel.pipeline_2bw": "lit_mesh.parallel.pipeline.twobw",
    "lit_mesh.parallel.tensor_grid": "lit_mesh.parallel.grid.grid",
    "lit_mesh.parallel.summa": "lit_mesh.parallel.grid.summa",
    "lit_mesh.parallel.tensor_3d": "lit_mesh.parallel.grid.cube",
    "lit_mesh.parallel.tensor_nd": "lit_mesh.parallel.grid.apply",
    "lit_mesh.parallel.tensor_nd_bytes": "lit_mesh.parallel.grid.bytes",
    "lit_mesh.parallel.context_attention": "lit_mesh.parallel.context.attention",
    "lit_mesh.parallel.context_kernels": "lit_mesh.parallel.context.kernels",
    "lit_mesh.parallel.context_layout": "lit_mesh.parallel.context.layout",
    "lit_mesh.parallel.checkpointing": "lit_mesh.parallel.activation_checkpointing",
    "lit_mesh.planner.schedules": "lit_mesh.planner.pipeline_model",
    "lit_mesh.planner.options": "lit_mesh.planner.vocabulary",
    "lit_mesh.figures": "lit_mesh.monitor.figures",
    "lit_mesh.topology": "lit_mesh.comm.topology",
}


def moved_to(old: str) -> str | None:
    """The new path of an old module path, or of a module inside an old package path; None if it did not move."""
    if old in MOVED_MODULES:
        return MOVED_MODULES[old]
    parent, _, child = old.rpartition(".")
    new_parent = moved_to(parent) if parent else None
    return f"{new_parent}.{child}" if new_parent else None


def _is_import_machinery(filename: str) -> bool:
    # warnings.warn itself steps over importlib's bootstrap frames (they are not counted in stacklevel)
    return "importlib" in filename and "_bootstrap" in filename


def _caller_stacklevel() -> int:
    """The stacklevel for a warnings.warn in the caller that names the code doing the import: past this module,
    importlib.import_module and the import system."""
    level, frame = 1, sys._getframe(1)  # level 1: the function that calls warnings.warn
    while frame.f_back is not None:
        if frame.f_code.co_filename not in (__file__, importlib.__file__) and not _is_import_machinery(
            frame.f_code.co_filename
        ):
            break
        frame = frame.f_back
        if not _is_import_machinery(frame.f_code.co_filename):
            level += 1
    return level


class _MovedModuleLoader(importlib.abc.Loader):
    """Loads an old path as the new module itself: exec_module puts the new module under the old name, and the
    import system returns whatever sys.modules then holds (the placeholder it made is dropped)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a placeholder module, replaced in exec_module

    def exec_module(self, module: ModuleType) -> None:
        warnings.warn(
            f"{module.__name__} moved to {self.new}: import it from there ({module.__name__} stops working in the"
            " next release)",
            DeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
        sys.modules[module.__name__] = import_module(self.new)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of MOVED_MODULES (and modules under them); nothing else."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = moved_to(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new))


def alias_moved_modules() -> None:
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
