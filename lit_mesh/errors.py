"""Every error class lit-mesh raises for bad input, in one place. Each message names the value and the fix.

They are ValueErrors (bad input); the modules that raise them re-export them under their old homes
(lit_mesh.mesh.MeshConfigError, lit_mesh.parallel.tensor.PlanError, ...), so user imports keep working.
"""

from __future__ import annotations


class MeshConfigError(ValueError):
    """A mesh degree that cannot work, with the numbers and the fix in the message."""


class WorldSizeError(MeshConfigError, RuntimeError):
    """Degrees whose product is not the world size (a RuntimeError too, as ModelParallelStrategy raises it)."""


class PipelineConfigError(MeshConfigError):
    """A pipeline setting that cannot work, with the numbers and the fix."""


class TopologyError(MeshConfigError):
    """A topology that cannot hold the mesh, or contradicts the cluster environment."""


class PlanError(ValueError):
    """A plan that cannot be applied to this model on this mesh, with the numbers and the fix."""


class ContextParallelError(PlanError):
    """Input that context parallelism cannot split exactly, with the numbers and the fix."""


class CompressionConfigError(ValueError):
    """A gradient-compression setting that cannot work, with the value and the fix in the message."""


__all__ = [
    "CompressionConfigError",
    "ContextParallelError",
    "MeshConfigError",
    "PipelineConfigError",
    "PlanError",
    "TopologyError",
    "WorldSizeError",
]
