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


from lit_mesh.registration import alias_moved_modules, register_mesh_strategy

# the public names, imported on first use: `import lit_mesh` (and the `lit-mesh` command, which Python imports
# through this package) stays free of torch and Lightning until something needs them
_EXPORTS = {
    "CompressionLogger": "lit_mesh.comm",
    "CompressionOptions": "lit_mesh.comm",
    "CompressionPhase": "lit_mesh.comm",
    "OneBitAdam": "lit_mesh.comm.onebit_adam",
    "Init": "lit_mesh.init",
    "init_parameters": "lit_mesh.init",
    "MeshConfigError": "lit_mesh.mesh",
    "MeshLayout": "lit_mesh.mesh",
    "GradientNormMonitor": "lit_mesh.monitor",
    "MeshMonitor": "lit_mesh.monitor",
    "loss_of": "lit_mesh.parallel.pipeline",
    "output_of": "lit_mesh.parallel.pipeline",
    "PipelineTimeline": "lit_mesh.monitor.pipeline_timeline",
    "PlanError": "lit_mesh.errors",
    "ParallelPlan": "lit_mesh.plan",
    "TensorPlan": "lit_mesh.plan",
    "PipelinePlan": "lit_mesh.plan",
    "ContextPlan": "lit_mesh.plan",
    "MoEPlan": "lit_mesh.plan",
    "MeshStrategy": "lit_mesh.strategy",
    "FP16MixedPrecision": "lit_mesh.training.precision",
    "Topology": "lit_mesh.comm.topology",
    "TopologyError": "lit_mesh.comm.topology",
    "FaultInjector": "lit_mesh.reliability.faults",
    "Preemption": "lit_mesh.reliability.preemption",
    "newest_checkpoint": "lit_mesh.checkpoint.resume",
}
register_mesh_strategy()
alias_moved_modules()


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
    "CompressionLogger",
    "CompressionOptions",
    "CompressionPhase",
    "ContextPlan",
    "FaultInjector",
    "FP16MixedPrecision",
    "GradientNormMonitor",
    "Init",
    "MeshConfigError",
    "MeshLayout",
    "MeshMonitor",
    "MeshStrategy",
    "MoEPlan",
    "OneBitAdam",
    "ParallelPlan",
    "PipelinePlan",
    "PipelineTimeline",
    "PlanError",
    "Preemption",
    "TensorPlan",
    "Topology",
    "TopologyError",
    "init_parameters",
    "newest_checkpoint",
    "loss_of",
    "output_of",
]
