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


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names it, what is wrong, and the checkpoint to use instead."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """A path that is no (complete) checkpoint; a ValueError too, as ModelParallelStrategy raises it."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that would run code if loaded (a pickled function or class no checkpoint holds), named."""


class OutputPathError(ValueError):
    """An output path that would destroy what is there (an existing file or directory, the input itself)."""


__all__ = [
    "CheckpointError",
    "CompressionConfigError",
    "ContextParallelError",
    "MeshConfigError",
    "NotACheckpointError",
    "OutputPathError",
    "PipelineConfigError",
    "PlanError",
    "TopologyError",
    "UnsafeCheckpointError",
    "WorldSizeError",
]
