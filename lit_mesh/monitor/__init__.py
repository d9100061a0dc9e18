"""See what a run does: throughput, MFU, memory and communication by mesh dim, the gradient norm, the pipeline
bubble (`pipeline_timeline`); `figures` sends the pictures the project draws (monitors and planner) to the loggers."""

from lit_mesh.monitor.callback import MeshMonitor
from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.monitor.gradient_norm import GradientNormMonitor

__all__ = ["CollectiveBytes", "GradientNormMonitor", "MeshMonitor"]
