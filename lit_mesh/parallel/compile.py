"""torch.compile per block: each block's forward body is compiled; the hooks around it (FSDP2's gathers,
activation checkpointing) stay eager, so no collective or checkpoint logic has to be traced."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lit_mesh.mesh import MeshConfigError


def check_compile_backend(backend: str) -> None:
    """Refuse, before any process starts, a backend torch.compile does not have (compile with tp > 1: see
    lit_mesh/rules.py, "compile_with_tp")."""
    backends = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if backend not in backends:
        raise MeshConfigError(f"compile_backend={backend!r} is not a torch.compile backend; choose one of {backends}")


def apply_compile(blocks: Sequence[nn.Module], backend: str) -> None:
    # Identical blocks share one graph: dynamo passes each block's parameters in as inputs.
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend)  # type: ignore[method-assign]
