"""Layout-independent parameter initialisation.

Every parameter is drawn from its own generator, seeded by (seed, parameter name), over its full global
shape; a rank then keeps only its shard. The weights are therefore the same on one device and on any mesh,
whatever the creation order. torch's DTensor random ops do not give this on CPU (they fall back to
per-rank streams), so we write our own.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass(frozen=True)
class Init:
    """How one parameter starts: normal(0, std), normal truncated at 2 std, zeros or ones."""

    kind: Literal["normal", "trunc_normal", "zeros", "ones"] = "normal"
    std: float = 0.02

    def sample(self, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        if self.kind == "zeros":
            return torch.zeros(shape)
        if self.kind == "ones":
            return torch.ones(shape)
        values = torch.empty(shape)
        if self.kind == "normal":
            return values.normal_(0.0, self.std, generator=generator)
        if self.kind == "trunc_normal":
            return nn.init.trunc_normal_(values, 0.0, self.std, -2 * self.std, 2 * self.std, generator=generator)
        raise ValueError(f"Init.kind={self.kind!r} is not one of 'normal', 'trunc_normal', 'zeros', 'ones'")


def rule_for(name: str, rules: Sequence[tuple[str, Init]]) -> Init:
    for pattern, init in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return init
    raise ValueError(f"no init rule matches parameter {name!r}; add a pattern for it (e.g. ('*', Init()))")


def parameter_generator(seed: int, name: str) -> torch.Generator:
    # crc32 is stable across processes and Python versions (hash() is salted per process)
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


@torch.no_grad()
def init_parameters(module: nn.Module, rules: Sequence[tuple[str, Init]], seed: int | None = None) -> None:
    """Fill every parameter of `module` (plain or DTensor, on any device) by `rules`.

    The seed defaults to torch's initial seed, so `seed_everything(s)` fixes the weights.
    Peak extra memory is one full parameter on the CPU, never the whole model.
    """
    seed = torch.initial_seed() if seed is None else seed
    for name, param in module.named_parameters():
        full = rule_for(name, rules).sample(param.shape, parameter_generator(seed, name))
        if isinstance(param, DTensor):
            # src_data_rank=None: each rank slices its own shard, no communication
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
