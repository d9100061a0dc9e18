"""Where the ranks sit: nodes, devices per node, links, and the time of ring collectives over them.

Where the ranks sit: nodes, devices per node and the two link classes (inside a node, between nodes), with
the alpha-beta time of ring collectives over a link (the one formula: the planner and the hierarchical
all-reduce import it from here).

Ranks are numbered node-major, as every launcher does it (SLURM, torchrun, Lightning): node = rank // devices
per node. Read from Lightning's cluster environment and the Trainer's `num_nodes` x `devices`, or given
explicitly (`MeshStrategy(topology=Topology(nodes=4, devices_per_node=8))`, also as LightningCLI YAML).
MeshStrategy checks the mesh against it (RULES: the mesh fills the nodes, tp inside a node) and prints the placement.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, cast

from lit_mesh.errors import TopologyError  # noqa: F401 - re-exported (lit_mesh.TopologyError)
from lit_mesh.mesh import MESH_AXES, MeshLayout
from lit_mesh.unit import Facts, Rule

GB = 1e9

# The link defaults of Topology and of the planner's Hardware: an H100 SXM node (NVLink 450 GB/s per device and
# direction, one 400 Gb/s NIC per GPU). Bandwidths in bytes/s, latencies (alpha) in seconds per ring step.
INTRA_NODE_BANDWIDTH = 450 * GB
INTER_NODE_BANDWIDTH = 50 * GB
INTRA_NODE_LATENCY = 5e-6
INTER_NODE_LATENCY = 15e-6

Link = tuple[float, float]  # (bandwidth in bytes/s, alpha in seconds per ring step)


def all_gather_time(nbytes: float, k: int, link: Link) -> float:
    """Time of a ring all-gather or reduce-scatter over k ranks (alpha-beta model).

    Ring all-gather or reduce-scatter over k ranks, each holding (or producing) nbytes of the whole:
    (k - 1) * alpha + (k - 1) / k * nbytes / bandwidth.
    """
    bandwidth, alpha = link
    return 0.0 if k <= 1 else (k - 1) * alpha + (k - 1) / k * nbytes / bandwidth


def all_reduce_time(nbytes: float, k: int, link: Link) -> float:
    """Ring all-reduce: a reduce-scatter, then an all-gather."""
    return 2 * all_gather_time(nbytes, k, link)


@dataclass(frozen=True)
class Topology:
    """Devices on nodes with an alpha-beta model of each link class.

    Bandwidths are bytes/s per device and direction; latencies (alpha) seconds per ring step. The defaults are
    an H100 SXM node (the module's INTRA/INTER_NODE_* constants, shared with lit_mesh.planner.hardware): one NIC per
    device, so a node's rails together carry devices x inter_node_bandwidth. `nvls`: the node's NVSwitches reduce
    (NVLink SHARP), which NCCL's all-reduce uses.
    `nodes` / `devices_per_node` left None are read from the cluster environment (give only the links).
    """

    nodes: Optional[int] = None
    devices_per_node: Optional[int] = None
    intra_node_bandwidth: float = INTRA_NODE_BANDWIDTH
    inter_node_bandwidth: float = INTER_NODE_BANDWIDTH
    intra_node_latency: float = INTRA_NODE_LATENCY
    inter_node_latency: float = INTER_NODE_LATENCY
    nvls: bool = False  # NVLink SHARP in the node's switches (H100/H200 HGX): NCCL's NVLS all-reduce

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"Topology({name}={value!r}) must be a positive int")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise TopologyError(f"Topology({name}={getattr(self, name)!r}) must be > 0 bytes/s")

    # these read a resolved topology (topology_from_environment fills nodes and devices_per_node)
    @property
    def world_size(self) -> int:
        return cast(int, self.nodes) * cast(int, self.devices_per_node)

    def node_of(self, rank: int) -> int:
        return rank // cast(int, self.devices_per_node)

    def local_rank_of(self, rank: int) -> int:
        return rank % cast(int, self.devices_per_node)

    def link(self, ranks: list[int]) -> Link:
        """(bandwidth, alpha) of a group: the intra-node link when all its ranks share a node."""
        if len({self.node_of(r) for r in ranks}) <= 1:
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency

    # ---- the mesh on the nodes ------------------------------------------------------------------------------

    def startup_report(self, layout: MeshLayout, reductions: Sequence[str] = (), max_ranks: int = 16) -> str:
        """What rank 0 prints at start, once.

        What rank 0 prints at start, once: the mesh, the topology, how gradients and metrics are all-reduced,
        and where the first `max_ranks` ranks sit.
        """
        lines = [
            f"MeshStrategy: mesh {layout.describe()}",
            f"  topology: {self.nodes} node(s) x {self.devices_per_node} device(s)",
        ]
        lines += [f"  {line}" for line in reductions]
        return "\n".join([*lines, self.placement(layout, max_ranks)])

    def placement(self, layout: MeshLayout, max_ranks: int = 16) -> str:
        """Where each rank sits: node, local rank, mesh coordinates.

        rank -> node, local rank, mesh coordinates: one line per rank, the first `max_ranks`, then one line for
        the rest.
        """
        shape = [getattr(layout, axis) for axis in MESH_AXES]
        lines = ["  ranks:"]
        for rank in range(min(layout.world_size, max_ranks)):
            coords, rest = [], rank
            for size in reversed(shape):
                coords.append(rest % size)
                rest //= size
            where = ", ".join(f"{axis}={c}" for axis, c in zip(MESH_AXES, reversed(coords)))
            lines.append(
                f"    rank {rank:>4} -> node {self.node_of(rank)}, local rank {self.local_rank_of(rank)}: {where}"
            )
        if layout.world_size > max_ranks:
            lines.append(
                f"    ... ({layout.world_size - max_ranks} more ranks, node = rank // {self.devices_per_node})"
            )
        return "\n".join(lines)


def as_topology(value: Any) -> Optional[Topology]:
    """A Topology, or a mapping of its fields (Python code passing a planned config's `topology:` as a dict)."""
    if value is None or isinstance(value, Topology):
        return value
    if isinstance(value, Mapping):
        names = [f.name for f in fields(Topology)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise TopologyError(f"topology keys {unknown} are not Topology fields; use some of {names}")
        return Topology(**value)
    raise TopologyError(f"topology={value!r} must be a lit_mesh.Topology, a mapping of its fields, or None")


def topology_from_environment(
    cluster_environment: Any, num_nodes: int, devices_per_node: int, given: Optional[Topology] = None
) -> Topology:
    """The topology of the run, read from the cluster environment and checked.

    The topology of the run: Lightning's cluster environment and the Trainer's num_nodes x devices, checked
    against each other (and against `given`, whose link figures are kept). Called before any process spawns.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    if isinstance(cluster_environment, SLURMEnvironment):
        _check_slurm(num_nodes, devices_per_node)
    elif isinstance(cluster_environment, TorchElasticEnvironment):
        _check_torchelastic(num_nodes, devices_per_node)
    if given is None:
        return Topology(nodes=num_nodes, devices_per_node=devices_per_node)
    world = num_nodes * devices_per_node
    if given.devices_per_node is None and given.nodes is not None and world % given.nodes:
        raise TopologyError(
            f"topology nodes={given.nodes} does not divide the world size {world} (num_nodes={num_nodes} x"
            f" devices={devices_per_node}); choose nodes in {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if given.devices_per_node is None:  # only the links given, or only the node count
        per_node = devices_per_node if given.nodes is None else num_nodes * devices_per_node // given.nodes
        given = replace(given, devices_per_node=max(per_node, 1))
    given_per_node = cast(int, given.devices_per_node)  # given, or set just above
    if given.nodes is None:
        given = replace(given, nodes=max(num_nodes * devices_per_node // given_per_node, 1))
    if world % given_per_node:
        raise TopologyError(
            f"topology devices_per_node={given.devices_per_node} does not divide the world size {world}"
            f" (num_nodes={num_nodes} x devices={devices_per_node}); choose devices_per_node in"
            f" {[d for d in range(1, world + 1) if world % d == 0]}"
        )
    # One machine under Lightning's own launcher may be split into simulated nodes; a node count that comes
    # from outside (SLURM, torchrun, num_nodes > 1) must be the topology's.
    external = isinstance(cluster_environment, (SLURMEnvironment, TorchElasticEnvironment)) or num_nodes > 1
    if given.world_size != world or (external and given.nodes != num_nodes):
        source = type(cluster_environment).__name__
        raise TopologyError(
            f"topology=Topology(nodes={given.nodes}, devices_per_node={given.devices_per_node}) contradicts the"
            f" run: {source} and the Trainer give num_nodes={num_nodes} x devices={devices_per_node}; set"
            f" Trainer(num_nodes={given.nodes}, devices={given.devices_per_node}), or give a topology with"
            f" nodes={num_nodes}, devices_per_node={devices_per_node} (or none: it is read from the environment)"
        )
    return given


def _check_slurm(num_nodes: int, devices: int) -> None:
    # Lightning checks these too, but only once the launcher runs; here with what to put in the sbatch script
    nnodes, per_node, ntasks = (os.environ.get(k) for k in ("SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS"))
    if nnodes is not None and int(nnodes) != num_nodes:
        raise TopologyError(
            f"Trainer(num_nodes={num_nodes}) but the SLURM allocation has {nnodes} nodes (SLURM_NNODES);"
            f" set num_nodes={nnodes}, or submit with #SBATCH --nodes={num_nodes}"
        )
    if per_node is not None and per_node.isdigit() and int(per_node) != devices:
        raise TopologyError(
            f"Trainer(devices={devices}) but SLURM runs {per_node} tasks per node (SLURM_NTASKS_PER_NODE);"
            f" set devices={per_node}, or submit with #SBATCH --ntasks-per-node={devices}"
        )
    if ntasks is not None and int(ntasks) != num_nodes * devices:
        raise TopologyError(
            f"num_nodes={num_nodes} x devices={devices} = {num_nodes * devices} processes but SLURM runs"
            f" {ntasks} tasks (SLURM_NTASKS); the devices per node must divide the world: use"
            f" --ntasks-per-node={devices} on {num_nodes} nodes"
        )


def _check_torchelastic(num_nodes: int, devices: int) -> None:
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and int(local) != devices:
        raise TopologyError(
            f"Trainer(devices={devices}) but torchrun started {local} processes on this node"
            f" (--nproc-per-node); set devices={local}"
        )
    if world is not None and int(world) != num_nodes * devices:
        raise TopologyError(
            f"num_nodes={num_nodes} x devices={devices} = {num_nodes * devices} but torchrun's world has {world}"
            f" processes; set num_nodes={int(world) // max(devices, 1)} (torchrun --nnodes) or devices to match"
        )


def _node_devices(f: Facts) -> int:
    return f.topology.devices_per_node


def _gbps(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:g} GB/s"


def _tp_across_nodes(f: Facts) -> str:
    d = _node_devices(f)
    return (
        f"tp={f.layout.tp} does not divide the {d} devices of one node: tensor-parallel groups cross nodes"
        f" (their all-reduces per layer then run at {_gbps(f.topology.inter_node_bandwidth)} instead of"
        f" {_gbps(f.topology.intra_node_bandwidth)}); choose tp dividing {d}"
    )


RULES: list[Rule] = [
    Rule(
        "topology_holds_mesh",
        "launch",
        lambda f: f.layout.world_size != f.topology.world_size,
        lambda f: (
            f"the mesh has {f.layout.world_size} ranks ({f.layout.describe()}) but the topology has"
            f" {f.topology.nodes} nodes x {f.topology.devices_per_node} devices = {f.topology.world_size}; give"
            f" nodes x devices_per_node = {f.layout.world_size}"
        ),
        TopologyError,
    ),
    Rule(
        "tp_inside_node_strict",
        "launch",
        lambda f: f.options.communication.strict_topology and _node_devices(f) % f.layout.tp != 0,
        lambda f: _tp_across_nodes(f) + " (or strict_topology=False to run anyway)",
        TopologyError,
    ),
    Rule(
        "tp_inside_node",
        "launch",
        lambda f: _node_devices(f) % f.layout.tp != 0,
        lambda f: _tp_across_nodes(f),
        warn_only=True,
    ),
]
