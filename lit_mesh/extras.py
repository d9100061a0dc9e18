"""Optional dependencies: import them where they are used, failing with the extra that installs them.

The core (MeshStrategy, the zoo GPT/MoE, the quick start) needs none of these.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> (extra, what needs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("plots", "pictures (PipelineTimeline, `lit-mesh plan --plot`)"),
    "transformers": ("hf", "Hugging Face models, conversion and export"),
    "safetensors": ("hf", "reading pretrained weights (lit_mesh.checkpoint.pretrained)"),
    "tokenizers": ("hf", "tokenising a corpus (lit-mesh prepare-data)"),
    "datasets": ("data", "parquet input of lit-mesh prepare-data"),
    "sklearn": ("vision", "the digits data set of the ViT recipe"),
    "jinja2": ("bench", "the benchmark report (benchmarks/report.py)"),
    "torchao": ("fp8", "float8 training (MeshStrategy(float8=...))"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the pip command that installs it."""


def require(module: str) -> ModuleType:
    """Import `module` (a key of EXTRAS, or a submodule of one), or fail with the install command."""
    top = module.split(".")[0]
    extra, purpose = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != top:
            raise  # a dependency of the package itself is missing: torch's or pip's message says which
        raise MissingExtraError(
            f"{top} is needed for {purpose} but is not installed; install it with: pip install 'lit-mesh[{extra}]'"
            f" (from a clone: pip install -e '.[{extra}]')"
        ) from e


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files, no display)."""
    matplotlib = require("matplotlib")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot")
