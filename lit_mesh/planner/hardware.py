"""What the planner plans for: how many devices, how they sit on nodes, and what each one can do."""

from __future__ import annotations

from dataclasses import dataclass

from lit_mesh.comm.topology import (
    GB,
    INTER_NODE_BANDWIDTH,
    INTER_NODE_LATENCY,
    INTRA_NODE_BANDWIDTH,
    INTRA_NODE_LATENCY,
    Link,
)

GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    """Devices on nodes, with per-device memory, peak FLOP/s and the two link classes of an alpha-beta model.

    Bandwidths are per device and per direction, in bytes/s; latencies (alpha) in seconds per ring step.
    Defaults: an H100 SXM node (80 GB, 989 TFLOP/s dense bf16, 3.35 TB/s HBM; the links are lit_mesh.comm.topology's defaults).
    """

    nodes: int = 1
    devices_per_node: int = 8
    memory_bytes: float = 80 * GB
    peak_flops: float = 989e12
    intra_node_bandwidth: float = INTRA_NODE_BANDWIDTH
    inter_node_bandwidth: float = INTER_NODE_BANDWIDTH
    intra_node_latency: float = INTRA_NODE_LATENCY
    inter_node_latency: float = INTER_NODE_LATENCY
    reserve_bytes: float = 4 * GIB  # CUDA context, allocator fragmentation, kernels' workspaces
    memory_bandwidth: float = 3.35e12  # HBM bytes/s (H100 SXM); the memory-bound ops and the optimizer step
    compute_efficiency: float | None = None  # the fraction of peak the largest GEMMs reach; None: calibrated

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.compute_efficiency is not None and not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"compute_efficiency={self.compute_efficiency} must be in (0, 1]")
        if self.memory_bytes <= self.reserve_bytes:
            raise ValueError(
                f"per-device memory {self.memory_bytes / GIB:.1f} GiB leaves nothing after the reserve of"
                f" {self.reserve_bytes / GIB:.1f} GiB; give more memory or a smaller reserve"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserve_bytes

    def link(self, stride: int, size: int) -> Link:
        """(bandwidth, latency) of a group of `size` ranks spaced `stride` apart (consecutive ranks share a
        node): inside a node when the group's span fits in one, else bound by the inter-node links."""
        if stride * size <= self.devices_per_node:
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency
