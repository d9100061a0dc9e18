"""See what a run does: throughput, MFU, memory and communication by mesh dim."""

from lit_mesh.monitor.callback import MeshMonitor
from lit_mesh.monitor.comm import CollectiveBytes

__all__ = ["CollectiveBytes", "MeshMonitor"]
