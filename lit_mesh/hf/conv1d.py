"""Tensor-parallel styles for transformers' Conv1D (GPT-2's linears, weight stored (in, out)).

torch's ColwiseParallel/RowwiseParallel take only nn.Linear and nn.Embedding, and GPT-2 fuses q, k and v into
one Conv1D: a plain column split would hand rank 0 all of q and part of k. For the fused projection
(`parts=3`) each rank must hold its share of each third (DTensor's _StridedShard). Sharding the WEIGHT that
way computes right, but torch.distributed.checkpoint cannot save a _StridedShard tensor ("overlapping
chunks", torch 2.13), so the fused weight stays replicated over tp and only its OUTPUT is split that way:
every rank computes the whole projection (no tp saving on it) and keeps its heads of q, k and v; backward
gathers the output gradient. The attention then splits the local output at its local width
(`LocalSplitWidth`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from lit_mesh.parallel.hidden_states import HiddenStatesLayout


def _shard(dim: int, parts: int) -> Placement:
    return Shard(dim) if parts == 1 else _StridedShard(dim, split_factor=parts)


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    for name, placement in placements.items():
        param = getattr(module, name, None)
        if param is not None:
            dtensor = distribute_tensor(param, mesh, [placement], src_data_rank=None)  # every rank holds it whole
            module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))


class Conv1DColwise(ParallelStyle):
    """Split over the output features (`parts` equal fused projections each split alike); replicated
    input, local output (this rank's features)."""

    def __init__(self, parts: int = 1) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements: dict[str, Placement]
        if self.parts == 1:
            placements = {"weight": Shard(1), "bias": Shard(0)}
        else:
            placements = {"weight": Replicate(), "bias": Replicate()}  # see the module docstring
        output_share = _shard(2, self.parts)  # the output is (batch, sequence, features)

        def inputs(_m: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            x = args[0]
            return (
                x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False),
                *args[1:],
            )

        def outputs(_m: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
            # this rank's share of every part: exactly its heads of q, k and v (a local slice, no communication)
            return out.redistribute(placements=[output_share]).to_local()

        return distribute_module(
            module,
            device_mesh,
            lambda _n, m, mesh: _distribute(m, mesh, placements),
            inputs,  # type: ignore[arg-type]  # torch types input_fn -> None; its pre-hook's result replaces the inputs
            outputs,
        )


class Conv1DRowwise(ParallelStyle):
    """Split over the input features; the partial sums are reduced to `output_layout` (Replicate, or the
    sequence shard under SP)."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements: dict[str, Placement] = {"weight": Shard(0), "bias": Replicate()}

        def inputs(_m: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            return (DTensor.from_local(args[0], mesh, [Shard(-1)], run_check=False), *args[1:])

        def outputs(_m: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
            return out.redistribute(placements=[self.output_layout]).to_local()

        return distribute_module(
            module,
            device_mesh,
            lambda _n, m, mesh: _distribute(m, mesh, placements),
            inputs,  # type: ignore[arg-type]  # torch types input_fn -> None; its pre-hook's result replaces the inputs
            outputs,
        )


class LocalSplitWidth(ParallelStyle):
    """An attention that splits its fused q/k/v output at `attribute` (a global width): make it the local
    width; with SP also gather its hidden states first."""

    def __init__(self, attribute: str, sequence_parallel: bool) -> None:
        super().__init__()
        self.attribute = attribute
        self.gather = HiddenStatesLayout(Shard(1), Replicate()) if sequence_parallel else None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        setattr(module, self.attribute, getattr(module, self.attribute) // device_mesh.size())
        return self.gather._apply(module, device_mesh) if self.gather is not None else module
