"""What an all-reduce over n nodes x g ranks costs: NCCL's own (flat) against our hierarchical one.

NCCL is already topology-aware, so "flat" is modelled as NCCL runs it, after its own tuning model
(ncclTopoTuneModel in NCCL's src/graph/tuning.cc) and nccl-tests' bus bandwidth (busbw = algbw x 2(N-1)/N):

- ring: many channels, spread over every rail, so the bytes leaving a node share all its NICs (g x the per-device
  inter-node bandwidth), and every byte still crosses the node's links: bus bandwidth min(intra, g x inter). Latency:
  2(N-1) steps, of which 2(n-1) cross nodes.
- tree (several nodes): the same bus bandwidth at NCCL's 0.92, half of it as algorithm bandwidth (each byte goes up
  and down the tree); latency 2((g-1) intra + log2(n) inter) steps.
- NVLS (Topology(nvls=True): NVLink SHARP in the node's switches, H100/H200 HGX): the switch sums, each rank sends
  and receives S once; across nodes (NVLS tree) the node sums still cross every rail like the ring's.
NCCL takes the fastest; so does flat_time. Every collective also pays NCCL's base latency once: one for flat, three
for the hierarchy.

The hierarchical all-reduce (lit_mesh/comm/hierarchical.py) runs three NCCL collectives one after the other: a ring
reduce-scatter in the node, an all-reduce of S/g over n ranks (one per node, one NIC each), an all-gather in the node.
It wins only where the flat ring is bound by the node's own links (slow intra-node links, fast rails): it moves
(g-1)/g of S inside the node, not (N-1)/N.

Calibration (H100 SXM, NCCL 2.19-2.21, nccl-tests all_reduce_perf; the figures are from NVIDIA's answers in the
nccl-tests and nccl issue trackers): ring busbw ~370 GB/s on 8 GPUs of 450 GB/s NVLink line rate (0.82); 320-330 GB/s
on 4 nodes of 8 x 400 Gb/s rails (0.82 of their 400 GB/s); NVLS busbw ~480 GB/s, algbw ~275 GB/s (0.61 of the line
rate) on 8 GPUs.
"""

from __future__ import annotations

import math

from lit_mesh.comm.topology import Topology, all_gather_time

BUS_EFFICIENCY = 370 / 450  # NCCL's ring busbw over the line rate (NVLink and rails alike)
TREE_EFFICIENCY = 0.92  # NCCL's tuning model: tree bus bandwidth x 0.92 of the ring's
NVLS_ALGBW_FRACTION = 275 / 450  # NVLS all-reduce algbw over the NVLink line rate, 8 x H100
LAUNCH_LATENCY = 8.4e-6  # NCCL's base latency of a collective (ring, simple protocol): paid once per collective


def bus_bandwidth(n: int, g: int, topology: Topology) -> float:
    """NCCL's ring bus bandwidth of a group of n nodes x g ranks: the node's links, and across nodes all its rails."""
    intra, rails = topology.intra_node_bandwidth, g * topology.inter_node_bandwidth
    if n == 1:
        return BUS_EFFICIENCY * intra
    return BUS_EFFICIENCY * (rails if g == 1 else min(intra, rails))  # one rank per node: its NIC alone


def ring_time(nbytes: float, n: int, g: int, topology: Topology) -> float:
    ranks = n * g
    if ranks <= 1:
        return 0.0
    inter_steps = 2 * (n - 1)
    latency = (2 * (ranks - 1) - inter_steps) * topology.intra_node_latency + inter_steps * topology.inter_node_latency
    return latency + 2 * (ranks - 1) / ranks * nbytes / bus_bandwidth(n, g, topology)


def tree_time(nbytes: float, n: int, g: int, topology: Topology) -> float:
    """NCCL's double binary tree between nodes (a chain inside each): inf on one node, where NCCL rings."""
    if n <= 1:
        return math.inf
    latency = 2 * ((g - 1) * topology.intra_node_latency + math.log2(n) * topology.inter_node_latency)
    return latency + 2 * nbytes / (TREE_EFFICIENCY * bus_bandwidth(n, g, topology))


def nvls_time(nbytes: float, n: int, g: int, topology: Topology) -> float:
    """NVLink SHARP (inf where the topology has none, or one rank per node): the switch sums the node's ranks."""
    if not topology.nvls or g <= 1:
        return math.inf
    ranks = n * g
    switch = nbytes / (NVLS_ALGBW_FRACTION * topology.intra_node_bandwidth)
    if n == 1:
        return topology.intra_node_latency + switch
    rails = 2 * (ranks - 1) / ranks * nbytes / bus_bandwidth(n, g, topology)
    latency = topology.intra_node_latency + 2 * math.log2(n) * topology.inter_node_latency
    return latency + max(switch, rails)


def flat_time(nbytes: float, n: int, g: int, topology: Topology) -> float:
    """NCCL's all-reduce over n nodes x g ranks: the fastest of its algorithms."""
    if n * g <= 1:
        return 0.0
    fastest = min(
        ring_time(nbytes, n, g, topology), tree_time(nbytes, n, g, topology), nvls_time(nbytes, n, g, topology)
    )
    return LAUNCH_LATENCY + fastest


def hierarchical_time(nbytes: float, n: int, g: int, topology: Topology) -> float:
    """Reduce-scatter in the node, NCCL's all-reduce of S/g between nodes (one rank and one rail each), all-gather."""
    intra = (BUS_EFFICIENCY * topology.intra_node_bandwidth, topology.intra_node_latency)
    in_node = 2 * (LAUNCH_LATENCY + all_gather_time(nbytes, g, intra)) if g > 1 else 0.0
    return in_node + flat_time(nbytes / g, n, 1, topology)
