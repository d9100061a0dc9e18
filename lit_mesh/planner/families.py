"""Model families: what `lit-mesh plan` and the `lit-mesh` command know of models that lit_mesh does not import.

A family (the zoo's "gpt" and "moe", or a user's own) registers its config class and presets, how to build its
network (the planner builds it on the meta device and reads the shapes from its ParallelPlan), its training FLOPs
per token, the LightningModule and DataModule a written `lit-mesh fit` config names, and the modules whose classes
LightningCLI should know by their short names (`--model=GPTModule`).

Two ways in:
- an entry point of an installed distribution in the group "lit_mesh.families", named as the family, whose object
  is its ModelFamily; loaded the first time the planner or the command asks for it (the zoo declares its own in
  pyproject.toml):

      [project.entry-points."lit_mesh.families"]
      mine = "my_package.families:MINE"

- `register_family(family)` from code that is already imported (a script, a notebook, a test).

Nothing here imports torch: `lit-mesh plan --help` stays instant.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUP = "lit_mesh.families"


@dataclass(frozen=True)
class ModelFamily:
    name: str  # what `lit-mesh plan --model` takes
    config_class: type  # a dataclass: its fields are what --config-overrides may set
    presets: Mapping[str, Any]  # preset name -> config; the planner's rehearsal uses "tiny"
    build: Callable[[Any], Any]  # config -> the network (an nn.Module that declares parallel_plan())
    flops_per_token: Callable[[Any, int], float]  # (config, seq_len) -> training FLOPs per token
    lightning_module: str  # class path of its LightningModule (init_args: preset, config_overrides)
    data_module: str  # class path of a DataModule for it (init_args: global_batch_size, seq_len)
    cli_modules: tuple[str, ...] = ()  # imported before LightningCLI parses, so their classes resolve by short name

    def config(self, preset: str, **overrides: Any) -> Any:
        """The preset's config with `overrides` (fields of the config class; its checks run on the result)."""
        if preset not in self.presets:
            raise ValueError(f"unknown {self.name} preset {preset!r}; choose one of {sorted(self.presets)}")
        return dataclasses.replace(self.presets[preset], **overrides)


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily, replace: bool = False) -> ModelFamily:
    """Make `family` known by its name. Registering the same family again is a no-op; another family under a
    registered name is refused unless `replace`."""
    known = _FAMILIES.get(family.name)
    if known is not None and known != family and not replace:
        raise ValueError(
            f"a model family named {family.name!r} is registered already ({known.lightning_module}); give yours"
            " another name, or register_family(family, replace=True)"
        )
    _FAMILIES[family.name] = family
    return family


def _entry_points(name: str | None = None) -> list[EntryPoint]:
    found = entry_points(group=GROUP)
    return [ep for ep in found if name is None or ep.name == name]


def _load(ep: EntryPoint) -> ModelFamily:
    family = ep.load()
    if not isinstance(family, ModelFamily) or family.name != ep.name:
        raise TypeError(
            f"entry point {ep.name} = {ep.value!r} of group {GROUP!r} must name a lit_mesh.planner.families.ModelFamily"
            f" called {ep.name!r}; it gives {family!r}"
        )
    return register_family(family)


def family_names() -> list[str]:
    """The names of the registered families and of the installed ones (from metadata: nothing is imported)."""
    return sorted({*_FAMILIES, *(ep.name for ep in _entry_points())})


def _unknown(what: str) -> LookupError:
    names = family_names()
    return LookupError(
        f"no model family {what}; the registered and installed ones are {names or 'none'}. Register yours with"
        f" lit_mesh.planner.families.register_family(...) or an entry point in the group {GROUP!r} (pyproject.toml),"
        " and reinstall the package that declares it (pip install -e .) so that its entry point is seen"
    )


def family(name: str) -> ModelFamily:
    """The family called `name`, loading its entry point on first use."""
    if name not in _FAMILIES:
        for ep in _entry_points(name):
            _load(ep)
    if name not in _FAMILIES:
        raise _unknown(f"named {name!r}")
    return _FAMILIES[name]


def families() -> dict[str, ModelFamily]:
    """Every family: the registered ones and every installed entry point (loaded here)."""
    for ep in _entry_points():
        if ep.name not in _FAMILIES:
            _load(ep)
    return dict(_FAMILIES)


def _match(config: Any, pool: Mapping[str, ModelFamily]) -> ModelFamily | None:
    """The family of `config`'s class, or of its nearest base class."""
    candidates = [f for f in pool.values() if isinstance(config, f.config_class)]
    return min(candidates, key=lambda f: type(config).__mro__.index(f.config_class), default=None)


def family_of(config: Any) -> ModelFamily:
    """The family whose config class `config` is (installed families are loaded when no registered one matches)."""
    found = _match(config, _FAMILIES) or _match(config, families())
    if found is None:
        raise _unknown(f"has the config class {type(config).__module__}.{type(config).__qualname__}")
    return found


def import_cli_modules() -> list[str]:
    """Import every family's cli_modules (after loading the installed families), so that LightningCLI resolves
    their classes by short name; returns the modules imported."""
    modules = sorted({m for f in families().values() for m in f.cli_modules})
    for module in modules:
        importlib.import_module(module)
    return modules
