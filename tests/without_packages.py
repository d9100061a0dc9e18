"""`python tests/without_packages.py MOD[,MOD...] CODE`: run CODE as on a machine where those packages are not
installed (their imports fail and their distribution metadata is absent, so optional-import probes such as
torchmetrics' see them missing too)."""

from __future__ import annotations

import importlib.metadata as metadata
import sys

HIDDEN = set(sys.argv[1].split(","))
DISTRIBUTIONS = {"sklearn": "scikit-learn"}


def _hidden_distribution(name: str) -> bool:
    return name.lower().replace("_", "-") in {DISTRIBUTIONS.get(m, m) for m in HIDDEN}


_distribution = metadata.distribution


def _guarded_distribution(name: str) -> metadata.Distribution:
    if _hidden_distribution(name):
        raise metadata.PackageNotFoundError(name)
    return _distribution(name)


metadata.distribution = _guarded_distribution  # version() and requires() go through it
for module in HIDDEN:
    sys.modules[module] = None  # type: ignore[assignment]  # import raises ModuleNotFoundError, find_spec says None
exec(compile(sys.argv[2], "<code>", "exec"), {"__name__": "__main__"})
