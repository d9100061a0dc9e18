"""`import lit_mesh` makes `Trainer(strategy="mesh")` work without importing Lightning itself.

Lightning's StrategyRegistry lives in lightning.pytorch.strategies, whose import costs seconds (torch, Lightning):
too much for `lit-mesh --help` or `lit-mesh plan`. So: if Lightning is already loaded, "mesh" is registered now;
otherwise a one-shot import hook registers it the moment lightning.pytorch.strategies has finished loading.
Either way the entry builds MeshStrategy on demand (lit_mesh.strategy then re-registers the class itself).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
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

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
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
