"""Layout-independent parameter initialisation, and the materialisation of models built on the meta device.

Every parameter is drawn from its own generators, seeded by (seed, parameter name, block): its flattened global
tensor is cut into blocks of DRAW_BLOCK elements, each drawn on the CPU from a generator of its own, so a rank draws
only the blocks its shard touches (at most two beyond it per parameter) and copies only its shard to the device;
no rank holds a whole parameter on the host. Each value depends on (seed, name, position) alone, so the weights are
the same on one device and on any mesh, whatever the creation order. torch's DTensor random ops do not give this on
CPU (they fall back to per-rank streams), so we write our own. A parameter of one block draws exactly what a single
generator seeded by (seed, name) draws over its whole shape.

`materialize` allocates a parallelised meta model and initialises it: by its plan's init rules, else by a
registered initialiser (lit_mesh.hf registers transformers' own), else by each module's reset_parameters().
Parameters a pretrained source fills next are only allocated: no init kernels, no whole tensors drawn for them.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
import zlib
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Optional, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lit_mesh.meta_writes import built_on_meta_where, carry_meta_writes
from lit_mesh.plan import PlanError, PlanOwner


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
    """The first rule whose pattern matches the parameter name `name`."""
    for pattern, init in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return init
    raise ValueError(f"no init rule matches parameter {name!r}; add a pattern for it (e.g. ('*', Init()))")


# Elements per generator: a multiple of 16 (normal_ on the CPU transforms 16 uniform draws at a time, so a block
# draws the same values as the whole tensor would at those positions when it is the first), and small enough that
# a shard costs little beyond its own elements.
DRAW_BLOCK = 1 << 20


def parameter_generator(seed: int, name: str, block: int = 0) -> torch.Generator:
    """A generator seeded by `seed`, the parameter's name and the block: the same values on every layout and rank."""
    # crc32 is stable across processes and Python versions (hash() is salted per process)
    key = name if block == 0 else f"{name}#{block}"
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))


def draw_span(init: Init, numel: int, start: int, stop: int, seed: int, name: str) -> torch.Tensor:
    """Elements [start, stop) of the flattened parameter `name` of `numel` elements, drawn block by block."""
    if init.kind in ("zeros", "ones"):
        return init.sample(torch.Size([stop - start]), torch.Generator())
    span = torch.empty(stop - start)

    def draw(block: int) -> None:
        low, high = block * DRAW_BLOCK, min((block + 1) * DRAW_BLOCK, numel)
        values = init.sample(torch.Size([high - low]), parameter_generator(seed, name, block))
        first, last = max(start, low), min(stop, high)
        span[first - start : last - start] = values[first - low : last - low]

    blocks = range(start // DRAW_BLOCK, (stop - 1) // DRAW_BLOCK + 1)
    threads = min(torch.get_num_threads(), len(blocks))
    # dispatch modes (FakeTensorMode, a probe) are per thread: under one, draw here, where the mode sees it
    threads = 1 if _get_current_dispatch_mode() is not None else threads
    if threads > 1:  # blocks have generators of their own: drawn in any order, the same values
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(draw, blocks))
    else:
        for block in blocks:
            draw(block)
    return span


def draw_whole(init: Init, shape: torch.Size, seed: int, name: str) -> torch.Tensor:
    """The whole parameter `name` of `shape`."""
    numel = math.prod(shape)
    return draw_span(init, numel, 0, numel, seed, name).view(shape) if numel else torch.empty(shape)


def draw_local(init: Init, param: DTensor, seed: int, name: str) -> Optional[torch.Tensor]:
    """This rank's shard of the parameter `name`, drawing only the blocks it touches.

    None where the placements are not plain Shard/Replicate (FSDP over TP's _StridedShard: draw_whole, then
    local_part).
    """
    if not all(type(p) in (Shard, Replicate) for p in param.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if math.prod(shape) == 0:
        return torch.empty(shape)
    strides = torch.empty(param.shape, device="meta").stride()  # the whole tensor's, contiguous
    start = sum(o * st for o, st in zip(offset, strides))
    stop = sum((o + n - 1) * st for o, n, st in zip(offset, shape, strides)) + 1
    span = draw_span(init, math.prod(param.shape), start, stop, seed, name)
    return span.as_strided(tuple(shape), strides)  # the shard's box within the span it spans


# per module: names its parameters are drawn under instead of their own (a pipeline stage's copy of a tied parameter
# is drawn under the whole model's name for it, so both stages' copies start equal: parallel/pipeline/tied.py)
_DRAW_AS: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def draw_as(module: nn.Module, names: dict[str, str]) -> None:
    """Let `init_parameters(module, ...)` draw the parameter named each key as if it were named its value."""
    _DRAW_AS.setdefault(module, {}).update(names)


@torch.no_grad()
def init_parameters(
    module: nn.Module, rules: Sequence[tuple[str, Init]], seed: int | None = None, skip: Collection[int] = ()
) -> None:
    """Initialise every parameter of `module` by `rules`.

    Fill every parameter of `module` (plain or DTensor, on any device) by `rules`, but those whose id is in
    `skip` (a pretrained source fills them).

    The seed defaults to torch's initial seed, so `seed_everything(s)` fixes the weights; each parameter draws
    from its own generators, so skipping some leaves the others' values unchanged.
    A sharded parameter draws its shard's span (plus at most two blocks) on the CPU, never the whole tensor.
    """
    seed = torch.initial_seed() if seed is None else seed
    aliases = _DRAW_AS.get(module, {})
    for own_name, param in module.named_parameters():
        if id(param) in skip:
            continue
        name = aliases.get(own_name, own_name)
        init = rule_for(name, rules)
        if isinstance(param, DTensor):
            local = draw_local(init, param, seed, name)
            if local is None:
                local = local_part(draw_whole(init, param.shape, seed, name), param)
            param.to_local().copy_(local)
        else:
            param.copy_(draw_whole(init, param.shape, seed, name))


def local_part(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """This rank's part of the whole tensor `full`, as `param` (a DTensor of full's shape) holds it.

    Sliced where `full` lies (the host): distribute_tensor would first copy the whole tensor to the mesh's device, every rank
    every parameter. Plain Shard/Replicate placements only; others (FSDP over TP's _StridedShard) through
    distribute_tensor, whose src_data_rank=None slices locally too, without communication.
    """
    if all(type(p) in (Shard, Replicate) for p in param.placements):
        shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
        return full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


# An initialiser: initialises a materialised (possibly sharded) plan owner that has no init rules its own way,
# leaving the parameters whose ids it is given (a pretrained source fills them), and returns True; or returns
# False when the module is not of its kind (lit_mesh.hf registers transformers').
Initialiser = Callable[[nn.Module, Collection[int]], bool]
_INITIALISERS: list[Initialiser] = []


def register_initialiser(initialiser: Initialiser) -> None:
    """Let `materialize` initialise plan owners without init rules with `initialiser` (once; in order)."""
    if initialiser not in _INITIALISERS:
        _INITIALISERS.append(initialiser)


def _initialise_by_registered(module: nn.Module, skip: Collection[int]) -> bool:
    return any(initialise(module, skip) for initialise in _INITIALISERS)


def meta_modules(root: nn.Module) -> set[nn.Module]:
    """Modules holding parameters or buffers on the meta device (recorded before `to_empty`)."""
    return {
        m for m in root.modules() if any(t.is_meta for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
    }


@torch.no_grad()
def materialize(
    root: nn.Module, owners: Sequence[PlanOwner], device: torch.device, filled: Collection[str] = ()
) -> None:
    """Allocate meta tensors on `device` (each rank only its shards) and initialise them.

    Plan owners with init rules get layout-independent weights (init_parameters); owners a registered
    initialiser knows get its initialisation; other modules their reset_parameters(). A module that has
    none of these is an error, never silent uninitialised memory. `filled` names the parameters (as
    `root.named_parameters()` does) that the caller fills right after (lit_mesh.checkpoint.pretrained, which names any
    parameter it has no source for): they are allocated, not initialised; everything else still is, buffers
    (RoPE tables) included.
    """
    pending = meta_modules(root)
    if not pending:
        return
    tied = tied_parameters(root)
    root.to_empty(device=device)
    retie(tied, type(root).__name__)  # to_empty gives each use of a tied meta parameter its own copy
    names = set(filled)
    skip = {id(p) for name, p in root.named_parameters(remove_duplicate=False) if name in names}
    by_plan: set[nn.Module] = set()  # modules whose weights a plan's init rules (or a registered initialiser) set
    for owner in owners:
        owned = set(owner.module.modules())
        if owner.plan.init and owned & pending:
            init_parameters(owner.module, owner.plan.init, skip=skip)
            pending -= {m for m in owned if not any(True for _ in m.buffers(recurse=False))}
            by_plan |= owned
        elif owned & pending and _initialise_by_registered(owner.module, skip):
            pending -= owned
            by_plan |= owned
    missing = []
    for module in root.modules():  # a fixed order: every rank draws the same random numbers
        if module not in pending or _all_filled(module, skip):
            continue
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            _reset_whole(module, reset)
        else:
            missing.append(f"{type(module).__name__} ({built_on_meta_where(root, module)})")
    if missing:
        raise PlanError(
            f"modules {sorted(set(missing))} hold meta-device weights but have no reset_parameters() and no init"
            " rules in a parallel_plan(), so they cannot be initialised; give them a reset_parameters(), or build"
            " them with real weights (in the LightningModule's __init__, or under trainer.init_module() without"
            " empty_init=True)"
        )
    carry_meta_writes(root, by_plan)  # values set on the meta device in configure_model (lit_mesh/meta_writes.py)


def _all_filled(module: nn.Module, skip: Collection[int]) -> bool:
    """The module's own tensors are all parameters a pretrained source fills: nothing to initialise."""
    params = list(module.parameters(recurse=False))
    return bool(params) and all(id(p) in skip for p in params) and not any(True for _ in module.buffers(recurse=False))


def _reset_whole(module: nn.Module, reset: Any) -> None:
    """Run reset_parameters() on whole tensors, then keep this rank's shards.

    DTensor random init on CPU draws per rank, so resetting the shards directly would make the weights
    depend on the layout; drawing whole tensors in a fixed order does not.
    """
    sharded = {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    if not sharded:
        reset()
        return
    for name, p in sharded.items():
        whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
        module._parameters[name] = nn.Parameter(whole, requires_grad=p.requires_grad)
    try:
        reset()
    finally:
        drawn = {name: cast(nn.Parameter, module._parameters[name]) for name in sharded}  # reset() keeps parameters
        module._parameters.update(sharded)  # the FSDP/TP-managed parameters go back in place
    for name, p in sharded.items():
        p.to_local().copy_(local_part(drawn[name].detach(), p))


def tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter used by more than one module (tied embeddings), as its (module, name) uses."""
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                uses.setdefault(id(param), []).append((module, name))
    return [group for group in uses.values() if len(group) > 1]


def retie(tied: list[list[tuple[nn.Module, str]]], model_name: str) -> None:
    """Tie again what distributing the modules one by one untied: every use gets the first use's DTensor."""
    for (first_module, first_name), *others in tied:
        shared = first_module._parameters[first_name]
        for module, name in others:
            own = module._parameters[name]
            if isinstance(own, DTensor) and isinstance(shared, DTensor) and own.placements != shared.placements:
                raise PlanError(
                    f"{model_name}: tied parameter {first_name!r} of {type(first_module).__name__} is"
                    f" {shared.placements} but its tie in {type(module).__name__} is {own.placements}; give both"
                    " modules TP styles that shard the weight alike (embedding + head), or leave both unsharded"
                )
            module._parameters[name] = shared
