"""lit-mesh: one N-D DeviceMesh and every parallelism, as a PyTorch Lightning strategy.

Importing it registers the strategy under the name "mesh": `Trainer(strategy="mesh")`.
"""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("lit-mesh")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


from lit_mesh.registration import register_mesh_strategy

# the public names, imported on first use: `import lit_mesh` (and the `lit-mesh` command, which Python imports
# through this package) stays free of torch and Lightning until something needs them
_EXPORTS = {
    "CompressionLogger": "lit_mesh.comm", "CompressionOptions": "lit_mesh.comm", "CompressionPhase": "lit_mesh.comm",
    "OneBitAdam": "lit_mesh.comm.onebit_adam", "Init": "lit_mesh.init", "init_parameters": "lit_mesh.init",
    "MeshConfigError": "lit_mesh.mesh", "MeshLayout": "lit_mesh.mesh", "GradientNormMonitor": "lit_mesh.monitor",
    "MeshMonitor": "lit_mesh.monitor", "loss_of": "lit_mesh.parallel.pipeline", "output_of": "lit_mesh.parallel.pipeline",
    "PipelineTimeline": "lit_mesh.pipeline_timeline", "PlanError": "lit_mesh.errors",
    "ParallelPlan": "lit_mesh.plan", "TensorPlan": "lit_mesh.plan", "PipelinePlan": "lit_mesh.plan",
    "ContextPlan": "lit_mesh.plan", "MoEPlan": "lit_mesh.plan", "FP16MixedPrecision": "lit_mesh.precision", "MeshStrategy": "lit_mesh.strategy",
    "Topology": "lit_mesh.topology", "TopologyError": "lit_mesh.topology", "FaultInjector": "lit_mesh.faults",
    "Preemption": "lit_mesh.preemption", "newest_checkpoint": "lit_mesh.resume",
}
register_mesh_strategy()


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_mesh' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "__version__",
    "CompressionLogger", "CompressionOptions", "CompressionPhase", "ContextPlan", "FaultInjector", "FP16MixedPrecision",
    "GradientNormMonitor", "Init", "MeshConfigError", "MeshLayout", "MeshMonitor", "MeshStrategy", "MoEPlan",
    "OneBitAdam", "ParallelPlan", "PipelinePlan", "PipelineTimeline", "PlanError", "Preemption", "TensorPlan",
    "Topology", "TopologyError", "init_parameters", "newest_checkpoint",
    "loss_of", "output_of",
]  # fmt: skip
