"""Pretrained weights read straight into a parallelised model: each rank reads only its own slices.

A LightningModule that starts from pretrained weights defines `pretrained_sources()`: its parameter names ->
where each tensor comes from (a `TensorSource`: one tensor of a safetensors file, or a stack / concatenation /
transpose of such). After the strategy has sharded the model and allocated (not initialised) the parameters a
source fills, `load_pretrained(root, sources)` fills every parameter's local part: for a DTensor it works out
which global indices this rank holds along each dim (FSDP, TP and EP placements, strided ones included) and
reads only those rows/columns with safetensors' `get_slice`; a plain tensor is read whole. No rank builds the
full model; the extra memory is one local block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _get_shard_size_and_offsets
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from lit_mesh.extras import require

Index = list[torch.Tensor]  # per tensor dim: the sorted global indices to read


class PretrainedError(ValueError):
    """Pretrained weights that do not fit the model, naming the tensors and the fix."""


class Files:
    """Open safetensors files, by path, for the duration of one load."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack = stack
        self.handles: dict[Path, Any] = {}

    def slice(self, path: Path, key: str) -> Any:
        if path not in self.handles:
            safe_open = require("safetensors").safe_open
            self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.handles[path].get_slice(key)


class TensorSource(Protocol):
    shape: tuple[int, ...]

    def read(self, files: Files, index: Index) -> torch.Tensor:
        """The block of this tensor at the given global indices per dim."""
        ...


def _runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted indices -> maximal [start, stop) runs of consecutive values."""
    if len(indices) == 0:
        return []
    values = indices.tolist()
    runs, start, prev = [], values[0], values[0]
    for v in values[1:]:
        if v != prev + 1:
            runs.append((start, prev + 1))
            start = v
        prev = v
    runs.append((start, prev + 1))
    return runs


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file, read run by run (a contiguous block per combination of runs)."""

    path: Path
    key: str
    shape: tuple[int, ...]

    def read(self, files: Files, index: Index) -> torch.Tensor:
        tensor_slice = files.slice(self.path, self.key)
        if not self.shape:
            return tensor_slice[:]

        def block(dim: int, prefix: tuple[slice, ...]) -> torch.Tensor:
            if dim == len(self.shape):
                return tensor_slice[prefix]
            parts = [block(dim + 1, (*prefix, slice(a, b))) for a, b in _runs(index[dim])]
            if not parts:  # nothing of this dim on this rank (an uneven split)
                return torch.empty([len(i) for i in index])
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

        return block(0, ())


@dataclass(frozen=True)
class Transposed:
    """A 2-D source read transposed (e.g. a (out, in) hub weight held as (in, out))."""

    source: TensorSource
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(reversed(self.source.shape)))

    def read(self, files: Files, index: Index) -> torch.Tensor:
        return self.source.read(files, [index[1], index[0]]).t()


@dataclass(frozen=True)
class Stacked:
    """Sources of one shape stacked along a new dim 0 (per-expert tensors -> one (experts, ...) tensor)."""

    sources: tuple[TensorSource, ...]
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        shapes = {s.shape for s in self.sources}
        if len(shapes) != 1:
            raise PretrainedError(f"tensors stacked into one must share a shape; found {sorted(shapes)}")
        object.__setattr__(self, "shape", (len(self.sources), *shapes.pop()))

    def read(self, files: Files, index: Index) -> torch.Tensor:
        blocks = [self.sources[i].read(files, index[1:]) for i in index[0].tolist()]
        return torch.stack(blocks) if blocks else torch.empty([len(i) for i in index])


@dataclass(frozen=True)
class Concatenated:
    """Sources concatenated along `dim` (w1 and w3 -> a fused gate_up projection)."""

    sources: tuple[TensorSource, ...]
    dim: int
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        first = list(self.sources[0].shape)
        first[self.dim] = sum(s.shape[self.dim] for s in self.sources)
        object.__setattr__(self, "shape", tuple(first))

    def read(self, files: Files, index: Index) -> torch.Tensor:
        parts, offset = [], 0
        for source in self.sources:
            size = source.shape[self.dim]
            mine = index[self.dim][(index[self.dim] >= offset) & (index[self.dim] < offset + size)] - offset
            if len(mine):
                parts.append(source.read(files, [*index[: self.dim], mine, *index[self.dim + 1 :]]))
            offset += size
        return torch.cat(parts, dim=self.dim)


def local_index(param: torch.Tensor) -> Index:
    """The global indices, per dim, of the part of `param` this rank holds (all of them for a plain tensor).

    torch computes the same per-dim offsets in `compute_local_shape_and_global_offset` but returns only the
    first of each; strided shards (FSDP over TP on one dim) hold several runs, so we keep them all.
    """
    index = [torch.arange(n) for n in param.shape]
    if not isinstance(param, DTensor):
        return index
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the parameter's mesh"
    sharded: dict[int, torch.Tensor] = {}
    for mesh_dim, placement in enumerate(param.placements):
        if not isinstance(placement, (Shard, _StridedShard)):
            continue
        dim = placement.dim
        size, offsets = _get_shard_size_and_offsets(
            len(sharded.get(dim, index[dim])),
            mesh.size(mesh_dim),
            coordinate[mesh_dim],
            placement,
            sharded.get(dim),
            param.shape[dim],
            False,
        )
        sharded[dim] = cast(torch.Tensor, offsets) if size else torch.zeros(0, dtype=torch.long)
    for dim, offsets in sharded.items():
        index[dim] = offsets
    return index


def _read_local(source: TensorSource, files: Files, param: torch.Tensor) -> torch.Tensor:
    index = local_index(param)
    order = [torch.sort(i) for i in index]  # read in ascending order, then put rows where this rank holds them
    block = source.read(files, [values for values, _ in order])
    for dim, (_, positions) in enumerate(order):
        if not torch.equal(positions, torch.arange(len(positions))):
            block = block.index_select(dim, torch.argsort(positions))
    return block


def check_sources(model: nn.Module, sources: Mapping[str, TensorSource], unused: Sequence[str], where: str) -> None:
    """Every parameter of `model` (on the meta device is enough) has a source of its shape, and no file tensor
    is left over; else a PretrainedError naming them."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(sources))
    mismatched = [
        f"{name}: {tuple(sources[name].shape)} in {where}, {tuple(p.shape)} in the model"
        for name, p in params.items()
        if name in sources and tuple(sources[name].shape) != tuple(p.shape)
    ]
    parts = []
    if mismatched:
        parts.append(f"{len(mismatched)} tensors of another shape, e.g. " + "; ".join(mismatched[:3]))
    if missing:
        parts.append(f"{len(missing)} tensors missing from {where}, e.g. {missing[:3]}")
    if unused:
        parts.append(f"{len(unused)} tensors in {where} the model has no place for, e.g. {sorted(unused)[:3]}")
    if parts:
        raise PretrainedError(
            f"the pretrained weights do not fit {type(model).__name__} (" + "; ".join(parts) + "): load a directory"
            " saved from a model of this architecture and configuration (its config.json)"
        )


@torch.no_grad()
def fill_parameters(module: nn.Module, sources: Mapping[str, TensorSource]) -> int:
    """Copy every parameter's local part from its source; returns the bytes read."""
    read = 0
    with ExitStack() as stack:
        files = Files(stack)
        for name, param in module.named_parameters():
            if name not in sources:
                raise PretrainedError(f"parameter {name} of {type(module).__name__} has no pretrained source")
            local = param.to_local() if isinstance(param, DTensor) else param
            block = _read_local(sources[name], files, param)
            if tuple(block.shape) != tuple(local.shape):
                raise PretrainedError(
                    f"{name}: read a block of {tuple(block.shape)} for a local part of {tuple(local.shape)}"
                )
            local.copy_(block)
            read += block.numel() * block.element_size()
            del block
    return read


def declared_sources(root: nn.Module) -> dict[str, TensorSource]:
    """`root.pretrained_sources()` (parameter names -> sources), or {} when it declares none."""
    declare = getattr(root, "pretrained_sources", None)
    return dict(declare() or {}) if callable(declare) else {}


def load_pretrained(root: nn.Module, sources: Mapping[str, TensorSource]) -> None:
    """Fill `root`'s parameters from `sources` (its `declared_sources`), if any. The strategy calls this once
    the model is sharded and materialised, with these parameters allocated but not initialised; every
    parameter must have a source, else PretrainedError names it. A resumed checkpoint is loaded after, over it."""
    if sources:
        fill_parameters(root, sources)
