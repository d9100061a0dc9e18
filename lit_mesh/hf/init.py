"""Initialise a transformers model built on the meta device exactly as transformers would, on any mesh.

transformers initialises in `_init_weights(module)`, children before parents (`initialize_weights`); a parent
may set a child's weight (GPT-2 scales c_proj). We call it in that order on WHOLE tensors, drawn from the
global generator (the same on every rank after seed_everything), and each rank keeps its shards: the weights
do not depend on the layout. DTensor random ops would draw per rank on CPU, hence the whole tensors.

Parameters a pretrained source fills next are left alone, by transformers' own mechanism (as `from_pretrained`
does for loaded weights): they carry `_is_hf_initialized`, which its init functions honour, and are never made
whole.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_mesh.hf.blocks import find_blocks
from lit_mesh.hf.registry import is_transformers_model


def _children_first(module: nn.Module, init: Callable[[nn.Module], None]) -> Iterator[tuple[nn.Module, Callable]]:
    """(module, its _init_weights) in transformers' order; a nested PreTrainedModel brings its own."""
    for child in module.children():
        yield from _children_first(child, child._init_weights if is_transformers_model(child) else init)
    yield module, init


@contextmanager
def _whole_parameters(module: nn.Module, recurse: bool, skip: Collection[int]) -> Iterator[None]:
    """Swap the module's DTensor parameters (but those in `skip`) for whole local tensors; afterwards each rank
    keeps its shards."""
    swapped: dict[int, tuple[DTensor, torch.Tensor]] = {}  # by id: a tied parameter is drawn once
    places: list[tuple[nn.Module, str, nn.Parameter]] = []
    for owner in module.modules() if recurse else (module,):
        for name, param in owner._parameters.items():
            if isinstance(param, DTensor) and id(param) not in skip:
                if id(param) not in swapped:
                    whole = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
                    swapped[id(param)] = (param, nn.Parameter(whole, requires_grad=param.requires_grad))
                places.append((owner, name, param))
                owner._parameters[name] = swapped[id(param)][1]
    try:
        yield
    finally:
        for owner, name, param in places:
            owner._parameters[name] = param
    for dparam, whole in swapped.values():
        local = distribute_tensor(whole.detach(), dparam.device_mesh, dparam.placements, src_data_rank=None).to_local()
        dparam.to_local().copy_(local)


@contextmanager
def _marked_initialized(model: nn.Module, skip: Collection[int]) -> Iterator[None]:
    """transformers' init functions (and torch's, under its guard) leave the parameters in `skip` alone."""
    from transformers import initialization

    marked = [p for p in model.parameters() if id(p) in skip]
    for param in marked:
        param._is_hf_initialized = True  # type: ignore[attr-defined]
    try:
        with initialization.guard_torch_init_functions():
            yield
    finally:
        for param in marked:
            del param._is_hf_initialized  # type: ignore[attr-defined]


@torch.no_grad()
def initialise_weights(model: nn.Module, skip: Collection[int] = ()) -> bool:
    """transformers' own initialisation of `model` (materialised, possibly sharded), but of the parameters
    whose ids are in `skip`; False if not a transformers model. Each subtree beside the blocks' ancestors (each
    block, the embeddings, the head) is made whole once, initialised children first, then sharded back: never
    the whole model at once."""
    if not is_transformers_model(model):
        return False
    blocks = find_blocks(model)
    ancestors: set[nn.Module] = {model}
    if blocks:
        parts = blocks.split(".")
        ancestors |= {model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts) + 1)}

    def walk(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
        if module in ancestors:
            for child in module.children():
                walk(child, child._init_weights if is_transformers_model(child) else init)
            with _whole_parameters(module, recurse=False, skip=skip):
                init(module)
            return
        with _whole_parameters(module, recurse=True, skip=skip):
            for sub, sub_init in _children_first(module, init):
                sub_init(sub)

    if skip:
        with _marked_initialized(model, skip):
            walk(model, model._init_weights)
    else:
        walk(model, model._init_weights)
    return True
