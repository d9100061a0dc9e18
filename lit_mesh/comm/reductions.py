"""The run's reductions: replicated gradients (DDP, HSDP) over dp_replicate, and metrics over dp x cp, each
hierarchical where the topology makes it pay (lit_mesh/comm/hierarchical.py). Groups are found by mesh axis name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor

from lit_mesh.comm import hierarchical
from lit_mesh.comm.hierarchical import AllReduceMode, Hierarchy, build_hierarchy
from lit_mesh.comm.topology import Topology
from lit_mesh.mesh import MeshAxis, MeshViews


@dataclass
class Reductions:
    views: MeshViews
    replicate: Optional[Hierarchy] = None  # DDP/HSDP gradients (None: flat)
    metrics: Optional[Hierarchy] = None  # reduce() over dp x cp (None: flat)

    @classmethod
    def build(cls, views: MeshViews, topology: Topology, mode: AllReduceMode) -> Reductions:
        """Collective (every rank, same order): makes the node-local and cross-node groups."""

        def over(axis: str) -> Optional[Hierarchy]:
            group = views[axis].get_group()
            return build_hierarchy(views.root, views.axes_of(axis), group, topology, mode, axis)

        replicate = over(MeshAxis.DP_REPLICATE) if views.layout.dp_replicate > 1 else None
        metrics = over(MeshAxis.DP_CP) if views.dp_cp.size() > 1 else None
        return cls(views, replicate, metrics)

    def hierarchies(self) -> list[Hierarchy]:
        return [h for h in (self.replicate, self.metrics) if h is not None]

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any], reduce_op: Optional[Union[ReduceOp, str]]
    ) -> Any:
        """Over dp x cp by default: tp (and pp) ranks hold copies of the same value, not more samples."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        if group is None:
            group = self.views.dp_cp.get_group()
            op = reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
            h = self.metrics
            summed = op in ("sum", "mean", "avg") or (not isinstance(op, str) and op == ReduceOp.SUM)
            if h is not None and summed and tensor.is_floating_point() and h.use_hierarchical(tensor.nbytes):
                return hierarchical.all_reduce(tensor, h, average=op in ("mean", "avg"))
        return _sync_ddp(tensor, group=group, reduce_op=reduce_op)
