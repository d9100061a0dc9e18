"""Communication: gradient compression in the data-parallel reductions (fp16/bf16, PowerSGD, 1-bit, top-k), the
hierarchical all-reduce, and where the ranks sit (`topology`: nodes, links, ring times; the planner reads it too)."""

from lit_mesh.comm.compression import CompressionRun, CompressionSite
from lit_mesh.comm.logger import CompressionLogger
from lit_mesh.comm.options import CompressionConfigError, CompressionOptions, CompressionPhase

__all__ = [
    "CompressionConfigError",
    "CompressionLogger",
    "CompressionOptions",
    "CompressionPhase",
    "CompressionRun",
    "CompressionSite",
]
