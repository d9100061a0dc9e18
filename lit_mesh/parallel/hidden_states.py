"""A TP style that moves only a module's hidden states in or out of the sequence-sharded region.

torch's PrepareModuleInput needs one layout per positional input and cannot take an input that comes either
positionally or as a keyword. Hugging Face layers get their hidden states both ways (`layer(h, mask, ...)`,
`self_attn(hidden_states=h, ...)`), next to masks and caches that must pass untouched: hence this style.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor.parallel import ParallelStyle

from lit_mesh.errors import PlanError
from lit_mesh.parallel.regather import note_gathered

KEYWORD = "hidden_states"


class HiddenStatesLayout(ParallelStyle):
    """Redistribute the hidden states (first positional input, else `hidden_states=`) from `given` to `wanted`.

    The module receives a plain tensor (the local part of `wanted`), or with `keep_dtensor` the DTensor itself:
    then the column-wise linears inside take it as it is and autograd sums their input gradients as one DTensor,
    reduced once at this boundary (Megatron's one all-reduce, or reduce-scatter under SP, per region) instead of
    once per linear. The module's output must then be a plain tensor or a replicated DTensor (made plain here).
    `check(sequence_length)` runs first.
    """

    def __init__(
        self,
        given: Placement,
        wanted: Placement,
        check: Callable[[int], None] | None = None,
        keep_dtensor: bool = False,
    ) -> None:
        super().__init__()
        self.given, self.wanted, self.check, self.keep_dtensor = given, wanted, check, keep_dtensor

    def _convert(self, x: Any, mesh: DeviceMesh) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dtensor = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (self.given,), run_check=False)
        if self.check is not None:
            self.check(dtensor.shape[1])
        moved = dtensor.redistribute(placements=(self.wanted,))
        if not self.keep_dtensor:
            return moved.to_local()
        # its linears' saved input: re-gathered in backward (lit_mesh/parallel/regather.py)
        note_gathered(dtensor, moved)
        return moved

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._convert(args[0], device_mesh), *args[1:]), kwargs
            if KEYWORD in kwargs:
                return args, {**kwargs, KEYWORD: self._convert(kwargs[KEYWORD], device_mesh)}
            raise ValueError(
                f"{type(_module).__name__} got neither a positional input nor {KEYWORD}=: the plan's"
                " shard_input/gather_input style does not fit this module"
            )

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if self.keep_dtensor:
            module.register_forward_hook(_plain_output)
        return module


def _plain_output(module: nn.Module, _args: tuple, output: Any) -> Any:
    """The module's output as the code after it expects it: a plain tensor (a replicated DTensor's local copy)."""
    if not isinstance(output, DTensor):
        return output
    if all(placement.is_replicate() for placement in output.placements):
        return output.to_local()
    raise PlanError(
        f"{type(module).__name__} (TP style gather_input) returns a DTensor placed {output.placements}: its last"
        " linear should be rowwise, or give the module no gather_input style"
    )
