"""Context parallelism, the layout: the cp_style option, how a sequence is cut over the cp ranks, the positions each
rank holds, and the sharding/gathering of whole batches (see lit_mesh/parallel/context/apply.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from lit_mesh.errors import ContextParallelError, MeshConfigError, PlanError  # noqa: F401 - re-exported
from lit_mesh.unit import option

CPStyle = Literal["ring", "ulysses", "allgather"]
CP_STYLES: tuple[str, ...] = CPStyle.__args__  # type: ignore[attr-defined]
SEQUENCE_DIM = 1  # batches and activations are (batch, sequence, ...)


def check_cp_style(style: str) -> None:
    if style not in CP_STYLES:
        raise MeshConfigError(f"cp_style={style!r}; choose one of {CP_STYLES}")


@dataclass(frozen=True)
class ContextOptions:
    """The context-parallel unit's options (MeshStrategy's cp_style); the degree cp belongs to the mesh."""

    style: CPStyle = option(
        "ring",
        doc='"ring" (K/V blocks circulate, load-balanced causal), "ulysses" (all-to-all to head shards; cp must divide'
        ' the heads per tp rank) or "allgather" (all-gather K/V, load-balanced causal).',
        arg="cp_style",
    )

    def __post_init__(self) -> None:
        check_cp_style(self.style)


def is_load_balanced(style: str) -> bool:
    """Ring and allgather hold chunks i and 2·cp-1-i (equal causal work); Ulysses contiguous shards."""
    return style != "ulysses"


# ---- the layout of the sequence over the cp ranks -------------------------------------------------------


def _check_length(length: int, cp: int, load_balanced: bool) -> None:
    parts = 2 * cp if load_balanced else cp
    if length % parts:
        how = (
            f"2 x cp = {parts} chunks (load-balanced causal layout: rank i holds chunks i and 2·cp-1-i)"
            if load_balanced
            else f"cp = {parts} shards"
        )
        raise ContextParallelError(
            f"context parallel cuts the sequence into {how}, but the sequence length is {length}; use a sequence"
            f" length that is a multiple of {parts}"
        )


def local_chunks(cp: int, rank: int, load_balanced: bool) -> list[int]:
    """Indices of the chunks rank `rank` holds: of 2·cp chunks (load-balanced) or of cp."""
    return [rank, 2 * cp - 1 - rank] if load_balanced else [rank]


def shard_sequence(x: Tensor, cp: int, rank: int, load_balanced: bool, dim: int = SEQUENCE_DIM) -> Tensor:
    """This rank's part of `x` along `dim` (the whole sequence on every rank before)."""
    _check_length(x.shape[dim], cp, load_balanced)
    chunks = x.chunk(2 * cp if load_balanced else cp, dim=dim)
    return torch.cat([chunks[i] for i in local_chunks(cp, rank, load_balanced)], dim=dim)


def unshard_sequence(shards: list[Tensor], load_balanced: bool, dim: int = SEQUENCE_DIM) -> Tensor:
    """The whole sequence back from every rank's shard (rank order): the inverse of shard_sequence."""
    cp = len(shards)
    if not load_balanced:
        return torch.cat(shards, dim=dim)
    chunks: list[Optional[Tensor]] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def local_positions(local_length: int, cp: int, rank: int, load_balanced: bool, device: Any = None) -> Tensor:
    """Global positions (local_length,) of the tokens this rank holds."""
    whole = torch.arange(local_length * cp, device=device)
    return shard_sequence(whole, cp, rank, load_balanced, dim=0)


def shard_batch(batch: Any, cp_mesh: DeviceMesh, style: str) -> Any:
    """Every tensor of a batch with a sequence dim (ndim >= 2: inputs, targets, masks) -> this cp rank's part."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    cp, rank, balanced = cp_mesh.size(), cp_mesh.get_local_rank(), is_load_balanced(style)

    def shard(x: Tensor) -> Tensor:
        return shard_sequence(x, cp, rank, balanced) if x.dim() >= 2 else x

    return apply_to_collection(batch, Tensor, shard)


def gather_batch(output: Any, cp_mesh: DeviceMesh, style: str) -> Any:
    """The whole sequence back on every cp rank, in token order, for every tensor with a sequence dim (ndim >= 2):
    what predict returns is then the same as on one device."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    cp, balanced = cp_mesh.size(), is_load_balanced(style)

    def gather(x: Tensor) -> Tensor:
        if x.dim() < 2:
            return x
        parts = funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, cp_mesh.get_group()))
        return unshard_sequence(list(parts.chunk(cp, dim=0)), balanced)

    return apply_to_collection(output, Tensor, gather)
