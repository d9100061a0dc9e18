"""Hierarchical all-reduce over a group that spans nodes: n nodes holding g of its ranks each, in three collectives:

  1. reduce-scatter inside the node (g ranks, fast links): each rank holds the node's sum of 1/g of the tensor;
  2. all-reduce of that 1/g piece between nodes (n ranks, one per node: the slow links carry S/g, not S);
  3. all-gather inside the node.
Per rank, the bytes crossing nodes drop from 2(N-1)/N·S (one flat ring over N = n·g, as gloo runs it) to
2(n-1)/n·S/g, and the sequential inter-node ring steps from 2(N-1) to 2(n-1). NCCL's own all-reduce already spreads
its rings over every rail and uses trees across nodes, so with NCCL this pays only where the node's own links bound
the flat ring: opt in with allreduce="hierarchical", or "auto" (lit_mesh/comm/allreduce_cost.py compares the two).
Layered compression: the inter-node all-reduce (2) goes through a CompressionSite (lit_mesh/comm/compression.py) with the run's mode; the node-local collectives stay exact,
or with CompressionOptions(intra_mode=...) use that codec (a site "<site>:intra" of their own). PowerSGD, whose
factors need whole matrices, all-reduces the whole tensor inside the node instead and compresses the whole
tensor between nodes (every rank of a node sends the same factors on its own inter-node group).

Used for replicated gradients (DDP, HSDP's replicate axis: FSDP2's all-reduce hook, the seam compression uses,
lit_mesh/comm/fsdp.py) and metric reductions (MeshStrategy.reduce). torch has no hierarchical all-reduce on
gloo/NCCL process groups, hence ours. The groups come from the Topology (node = rank // devices per node).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lit_mesh.comm.allreduce_cost import flat_time, hierarchical_time  # noqa: F401 - re-exported
from lit_mesh.comm.compression import INTRA_SUFFIX, CompressionRun, CompressionSite
from lit_mesh.comm.fsdp import fsdp_units, unit_segments
from lit_mesh.comm.options import ALLREDUCE_MODES, AllReduceMode, check_allreduce_mode  # noqa: F401 - re-exported
from lit_mesh.comm.topology import Topology
from lit_mesh.mesh import group_pool

# ---- what crosses the node boundary (a single ring, as gloo runs it; NCCL spreads its rings over the rails) ---


def inter_node_bytes(nbytes: float, n: int, g: int, hierarchical: bool) -> float:
    """Bytes one rank sends across the node boundary (flat: every ring step's share is bound by it)."""
    if hierarchical:
        return 2 * (n - 1) / n * nbytes / g if n > 1 else 0.0
    return 2 * (n * g - 1) / (n * g) * nbytes if n > 1 else 0.0


def inter_node_steps(n: int, g: int, hierarchical: bool) -> int:
    """Sequential ring steps that cross nodes."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if hierarchical else 2 * (n * g - 1)


# ---- groups --------------------------------------------------------------------------------------------------


def groups_of(root: DeviceMesh, axes: tuple[str, ...]) -> list[list[int]]:
    """Every group of the mesh axes `axes` flattened together (the groups of all ranks, not only ours)."""
    names = root.mesh_dim_names or ()
    spanned = [names.index(axis) for axis in axes]  # positions in the rank tensor, looked up by name
    others = [i for i in range(root.mesh.dim()) if i not in spanned]
    size = math.prod(root.mesh.shape[i] for i in spanned)
    return root.mesh.permute(*others, *spanned).reshape(-1, size).tolist()


def split_by_node(groups: list[list[int]], topology: Topology) -> Optional[tuple[list[list[int]], list[list[int]]]]:
    """(intra-node lists, inter-node lists) of every group, or None where a group holds unequal numbers of
    ranks on the nodes it spans (no uniform hierarchy: flat it is)."""
    intra, inter = [], []
    for group in groups:
        by_node: dict[int, list[int]] = {}
        for rank in group:
            by_node.setdefault(topology.node_of(rank), []).append(rank)
        counts = {len(members) for members in by_node.values()}
        if len(counts) != 1:
            return None
        parts = list(by_node.values())
        intra.extend(parts)
        inter.extend([list(column) for column in zip(*parts)])
    return intra, inter


@dataclass
class Hierarchy:
    """One rank's view of a group split by node: `intra` (g ranks of its node), `inter` (n ranks, one per node)."""

    group: Any
    intra: Any
    inter: Any
    nodes: int  # n
    per_node: int  # g
    mode: AllReduceMode
    topology: Topology
    axis: str  # the mesh axis or view it reduces over, e.g. "dp_replicate"

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    def use_hierarchical(self, nbytes: float) -> bool:
        """ "hierarchical" always; "auto" where it beats NCCL's own all-reduce for this size (allreduce_cost.py)."""
        if self.mode == "hierarchical":
            return True
        return self.mode == "auto" and hierarchical_time(nbytes, self.nodes, self.per_node, self.topology) < flat_time(
            nbytes, self.nodes, self.per_node, self.topology
        )


def build_hierarchy(
    root: DeviceMesh,
    axes: tuple[str, ...],
    group: Any,
    topology: Topology,
    mode: AllReduceMode,
    name: str,
    skip_trivial: bool = True,
) -> Optional[Hierarchy]:
    """The hierarchy of the group over the mesh axes `axes` of `root` (call on every rank, in the same order: it
    creates process groups). None with mode "flat", or where it would change nothing (the group inside one node,
    or one rank per node; skip_trivial=False builds it anyway, for tests) or the group is not spread evenly over
    nodes. `name` names the group in logs and metrics ("dp_replicate", "dp_cp")."""
    if mode == "flat":
        return None
    split = split_by_node(groups_of(root, axes), topology)
    if split is None:
        return None
    intra_lists, inter_lists = split
    g, n = len(intra_lists[0]), len(inter_lists[0])
    if skip_trivial and (g == 1 or n == 1):
        return None
    pool = group_pool(root)  # the run's timeout; a node-local group equal to a mesh dim's is that dim's communicator
    intra, inter = pool.group_of_rank(intra_lists), pool.group_of_rank(inter_lists)
    return Hierarchy(group, intra, inter, n, g, mode, topology, name)


# ---- the all-reduce -------------------------------------------------------------------------------------------


@torch.no_grad()
def all_reduce(
    tensor: Tensor,
    hierarchy: Hierarchy,
    average: bool,
    site: Optional[CompressionSite] = None,
    segments: Optional[list] = None,
) -> Tensor:
    """tensor <- sum (or mean) over the hierarchy's whole group, in place, by the three collectives; with a
    compression site, the inter-node all-reduce is compressed (its bytes metered under "<axis>:inter", the
    node-local collectives exact under "<axis>:intra")."""
    g, n, axis = hierarchy.per_node, hierarchy.nodes, hierarchy.axis
    flat = tensor.reshape(-1)
    length = flat.numel()
    meter = site.run.meter if site is not None else None
    if site is not None and site.run.mode == "powersgd":
        whole = flat.clone()
        dist.all_reduce(whole, group=hierarchy.intra)
        if meter is not None:
            meter.sent(f"{axis}:intra", "all_reduce", whole, g)
            meter.uncompressed(f"{axis}:intra", "all_reduce", whole, g)
        site.all_reduce(whole, hierarchy.inter, average=average, dim=f"{axis}:inter", segments=segments)
        tensor.copy_((whole / g if average else whole).view_as(tensor))
        return tensor
    chunk = math.ceil(length / g)
    padded = torch.zeros(g * chunk, dtype=flat.dtype, device=flat.device)
    padded[:length] = flat
    piece = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
    intra = site.run.intra_site(site.name) if site is not None else None
    if intra is not None:  # the node's links get their own codec (CompressionOptions.intra_mode), error feedback
        intra.reduce_scatter(piece, padded, hierarchy.intra, average=False, dim=f"{axis}:intra", final=False)
    else:
        dist.reduce_scatter_tensor(piece, padded, group=hierarchy.intra)
    if site is None:
        dist.all_reduce(piece, group=hierarchy.inter)
    else:
        site.all_reduce(piece, hierarchy.inter, average=average, dim=f"{axis}:inter")
    if intra is not None:
        gathered = intra.all_gather(piece, hierarchy.intra, dim=f"{axis}:intra")
    else:
        gathered = torch.empty_like(padded)
        dist.all_gather_into_tensor(gathered, piece, group=hierarchy.intra)
        if meter is not None:
            for kind in ("reduce_scatter", "all_gather"):
                meter.sent(f"{axis}:intra", kind, padded, g)
                meter.uncompressed(f"{axis}:intra", kind, padded, g)
    result = gathered[:length]
    if average:  # a site averaged over the n nodes already
        result = result / (g if site is not None else g * n)
    tensor.copy_(result.view_as(tensor))
    return tensor


class HierarchicalReplicaAllReduce:
    """FSDP2's all-reduce hook over the replicate axis (DDP, HSDP): the mean over replicas of this rank's reduced
    gradient shard, hierarchically (or flat, where the cost model says so), with layered compression."""

    def __init__(self, hierarchy: Hierarchy, module: FSDPModule, site: Optional[CompressionSite]) -> None:
        self.hierarchy = hierarchy
        self.module = module
        self.site = site

    def __call__(self, reduced_shard: Tensor) -> None:
        powersgd = self.site is not None and self.site.run.mode == "powersgd"
        segments = unit_segments(self.module) if powersgd else None
        nbytes = reduced_shard.numel() * reduced_shard.element_size()
        if self.hierarchy.use_hierarchical(nbytes):
            all_reduce(reduced_shard, self.hierarchy, average=True, site=self.site, segments=segments)
        elif self.site is not None:
            self.site.all_reduce(reduced_shard, self.hierarchy.group, True, self.hierarchy.axis, segments)
        else:
            dist.all_reduce(reduced_shard, group=self.hierarchy.group)
            reduced_shard.div_(self.hierarchy.size)


def attach_hierarchical_all_reduce(
    root: nn.Module,
    hierarchy: Hierarchy,
    run: Optional[CompressionRun],
    extra_roots: Sequence[tuple[str, nn.Module]] = (),
) -> int:
    """Hook the replicate all-reduce of every FSDP2 unit under `root` and `extra_roots` (on a 1-D shard mesh, as
    compression does; the compression sites keep their names "<unit>:all_reduce", so checkpointed state finds
    them)."""
    hooked = 0
    for name, module in fsdp_units(root, extra_roots):
        site = run.site(f"{name}:all_reduce") if run is not None else None
        if run is not None and site is not None and run.options.intra_mode is not None:
            run.site(site.name + INTRA_SUFFIX)  # made now, so that a checkpoint finds every site on resume
        module.set_all_reduce_hook(HierarchicalReplicaAllReduce(hierarchy, module, site))
        hooked += 1
    return hooked
