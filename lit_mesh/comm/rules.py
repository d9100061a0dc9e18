"""Gradient compression's rules (lit_mesh/unit.py): what it needs of the checkpoints, the mesh and the model."""

from __future__ import annotations

from lit_mesh.errors import CompressionConfigError
from lit_mesh.unit import Rule

RULES: list[Rule] = [
    Rule(
        "compression_state_needs_sharded",
        "init",
        lambda f: f.options.communication.compression is not None and not f.options.checkpoint.distributed,
        lambda f: "grad_compression: single-file checkpoints do not hold its per-rank state; a resume restarts it",
        warn_only=True,
    ),
    Rule(
        "compression_needs_data_parallel",
        "launch",
        lambda f: f.options.communication.compression is not None and f.layout.data_parallel == "none",
        lambda f: (
            f"grad_compression={f.options.communication.compression.mode!r} but the mesh has no data-parallel"
            f" dim ({f.layout.describe()}): there is no gradient reduction to compress; give dp or dp_replicate > 1,"
            " or set grad_compression=None"
        ),
        CompressionConfigError,
    ),
    Rule(
        "self_parallelised_without_compression",
        "setup",
        lambda f: f.self_parallelised and f.options.communication.compression is not None,
        lambda f: (
            "grad_compression hooks into the data parallelism MeshStrategy applies, but configure_model"
            " parallelised the model itself; let MeshStrategy apply it (a parallel_plan()), or drop grad_compression"
        ),
        CompressionConfigError,
    ),
]
