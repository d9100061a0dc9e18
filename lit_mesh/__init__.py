"""lit-mesh: one N-D DeviceMesh and every parallelism, as a PyTorch Lightning strategy.

Importing it registers the strategy under the name "mesh": `Trainer(strategy="mesh")`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lit-mesh")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


from lit_mesh.comm import CompressionLogger, CompressionOptions, CompressionPhase
from lit_mesh.comm.onebit_adam import OneBitAdam
from lit_mesh.faults import FaultInjector
from lit_mesh.init import Init, init_parameters
from lit_mesh.mesh import MeshConfigError, MeshLayout
from lit_mesh.monitor import GradientNormMonitor, MeshMonitor
from lit_mesh.parallel.pipeline import loss_of, output_of
from lit_mesh.pipeline_timeline import PipelineTimeline
from lit_mesh.parallel.tensor import PlanError
from lit_mesh.plan import ParallelPlan
from lit_mesh.precision import FP16MixedPrecision
from lit_mesh.resume import newest_checkpoint
from lit_mesh.preemption import Preemption
from lit_mesh.strategy import MeshStrategy
from lit_mesh.topology import Topology, TopologyError

__all__ = [
    "__version__",
    "CompressionLogger", "CompressionOptions", "CompressionPhase", "FaultInjector", "FP16MixedPrecision", "GradientNormMonitor", "Init", "MeshConfigError",
    "MeshLayout", "MeshMonitor", "MeshStrategy", "OneBitAdam", "ParallelPlan", "PipelineTimeline", "PlanError", "Preemption", "Topology",
    "TopologyError", "init_parameters", "newest_checkpoint",
    "loss_of", "output_of",
]  # fmt: skip
