"""A model's TensorPlan on the multi-dimensional TP grid (tp_mode "2d", "2.5d", "3d"): the one place that applies it.

The plan is the same data as for 1-D TP (lit_mesh/parallel/tensor.py), read for a grid scheme (GridScheme,
lit_mesh/parallel/grid/grid.py, which states the contract each scheme's linear layer keeps):
  colwise, rowwise     the scheme's linear (both: in and out features split the same way in the grid layout)
  norm                 GridRMSNorm: the sum of squares all-reduced over the feature dims of the grid
  embedding            GridEmbedding: the table split over the hidden dim like the activations; each rank looks up
                       its batch block of the tokens, so its output is already in the layout (no communication)
  head, vocab_head     GridHead: the hidden states are gathered whole over the tp ranks, the head is replicated and
                       every tp rank computes the same full logits (the loss then sees what one device sees)
  gather_input, shard_*, whole_sequence   nothing: those move activations for sequence parallelism, which the grid
                       schemes do not use
Parameters a rank shares with others that saw other samples (norm weights, embedding, bias) get their gradients
summed over the layout's batch dims in backward (SumGradOver). The activations between blocks stay in the layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lit_mesh.errors import PlanError
from lit_mesh.init import tied_parameters
from lit_mesh.parallel.grid.grid import (
    GRID_DIMS,
    ActivationLayout,
    GridScheme,
    TPGrid,
    build_grid,
    grid_parameter,
    grid_shape,
    local_block,
)
from lit_mesh.parallel.grid.schemes import SCHEMES
from lit_mesh.parallel.grid.summa import SumGradOver
from lit_mesh.plan import ParallelPlan

if TYPE_CHECKING:  # an annotation only: the grid's rules, which mesh.py's checks reach, must not import the mesh
    from lit_mesh.mesh import MeshViews

# plan entries of `divides` the grid does not split: the head is replicated, the embedding split over the hidden dim
_WHOLE = ("vocab_size",)
_LINEAR_STYLES = ("colwise", "rowwise")
_NO_OP_STYLES = ("gather_input", "shard_input", "shard_output", "whole_sequence")


def _placements(grid: TPGrid, split: tuple[str, ...], tensor_dim: int) -> list[Any]:
    """Shard(tensor_dim) over the grid dims `split` (one dim only), Replicate over the others."""
    assert len(split) == 1, "parameters are split over one grid dim"
    return [Shard(tensor_dim) if name in split else Replicate() for name in GRID_DIMS]


class GridRMSNorm(nn.Module):
    """nn.RMSNorm over a hidden dim split over the layout's feature dims."""

    def __init__(self, norm: nn.RMSNorm, grid: TPGrid, layout: ActivationLayout) -> None:
        super().__init__()
        if len(norm.normalized_shape) != 1 or norm.weight is None:
            raise PlanError(f"the grid tp_modes take RMSNorm over the last dim with a weight, not {norm}")
        self.dim, self.eps = norm.normalized_shape[0], norm.eps
        self.features, self.batch = grid.group(layout.features), grid.group(layout.batch)
        self.weight = grid_parameter(norm.weight, grid, _placements(grid, layout.features, 0))

    def forward(self, x: Tensor) -> Tensor:
        squares = x.float().pow(2).sum(-1, keepdim=True)
        if self.features is not None:
            squares = _AllReduceSum.apply(squares, self.features)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        y = (x.float() * torch.rsqrt(squares / self.dim + eps)).type_as(x)
        return y * SumGradOver.apply(cast(DTensor, self.weight).to_local(), self.batch)


class _AllReduceSum(torch.autograd.Function):
    """Every rank gets the sum; its gradient is the sum of every rank's gradient (all-reduce both ways)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GridEmbedding(nn.Module):
    """nn.Embedding whose table (vocab, dim) is split over the hidden dim like the activations; takes the whole
    batch of tokens (every tp rank reads the same batch) and returns this rank's block of the layout."""

    def __init__(self, embedding: nn.Embedding, grid: TPGrid, layout: ActivationLayout) -> None:
        super().__init__()
        self.grid, self.layout, self.batch = grid, layout, grid.group(layout.batch)
        self.weight = grid_parameter(embedding.weight, grid, _placements(grid, layout.features, 1))

    def forward(self, tokens: Tensor) -> Tensor:
        _, blocks = self.grid.index(self.layout.batch)
        if tokens.shape[0] % blocks:
            fits = [n * blocks for n in range(1, 5)]
            raise PlanError(
                f"a batch of {tokens.shape[0]} samples does not split over the {blocks} batch blocks of tp_mode="
                f"{self.grid.mode!r} (grid depth {self.grid.depth} x {self.grid.q} x {self.grid.q}: the batch is split"
                f" over {' x '.join(self.layout.batch)}); use a batch size that is a multiple of {blocks}, e.g. {fits}"
            )
        local = local_block(tokens, self.grid, 0, self.layout.batch)
        return nn.functional.embedding(local, SumGradOver.apply(cast(DTensor, self.weight).to_local(), self.batch))


class _GatherLayout(torch.autograd.Function):
    """The whole (batch, ..., features) tensor on every tp rank from every rank's block. Backward keeps this
    rank's block of the gradient: every tp rank computes the same loss from the same whole tensor, so each holds
    the whole gradient already (a sum would count it once per rank)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, grid: TPGrid, layout: ActivationLayout) -> Tensor:
        ctx.grid, ctx.layout = grid, layout
        parts = [torch.empty_like(x) for _ in range(grid.tp.size())]
        dist.all_gather(parts, x.contiguous(), group=grid.tp.get_group())
        _, n_batch = grid.index(layout.batch)
        _, n_features = grid.index(layout.features)
        rows: list[list[Optional[Tensor]]] = [[None] * n_features for _ in range(n_batch)]
        for rank, part in enumerate(parts):
            coords = grid.coordinates_of(rank)
            (b, _), (f, _) = grid.index(layout.batch, coords), grid.index(layout.features, coords)
            if rows[b][f] is None:  # dims in neither list hold copies
                rows[b][f] = part
        return torch.cat([torch.cat(row, dim=-1) for row in rows], dim=0)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        block = local_block(local_block(grad, ctx.grid, 0, ctx.layout.batch), ctx.grid, -1, ctx.layout.features)
        return block.contiguous(), None, None


class GridHead(nn.Module):
    """The output projection, replicated on every tp rank, on the gathered hidden states."""

    def __init__(self, linear: nn.Linear, grid: TPGrid, layout: ActivationLayout) -> None:
        super().__init__()
        self.grid, self.layout = grid, layout
        whole = [Replicate()] * len(GRID_DIMS)
        self.weight = grid_parameter(linear.weight, grid, whole)
        self.bias = None if linear.bias is None else grid_parameter(linear.bias, grid, whole)

    def forward(self, x: Tensor) -> Tensor:
        h = _GatherLayout.apply(x, self.grid, self.layout)
        bias = None if self.bias is None else cast(DTensor, self.bias).to_local()
        return nn.functional.linear(h, cast(DTensor, self.weight).to_local(), bias)


def _replace(owner: nn.Module, name: str, make: Any) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = owner.get_submodule(parent_name) if parent_name else owner
    setattr(parent, child, make(parent.get_submodule(child)))


def _expect(module: nn.Module, kind: type, name: str, style: str, model_name: str) -> None:
    if not isinstance(module, kind):
        raise PlanError(
            f"{model_name}: {name} ({type(module).__name__}) has the TP style {style!r}; the grid tp_modes take"
            f" {kind.__name__} there; use tp_mode='1d' for this model"
        )


def grid_divides_problem(model: nn.Module, plan: ParallelPlan, mode: str, depth: int, q: int) -> Optional[str]:
    """Which size the grid splits into q blocks and q does not divide (None: every one): the plan's (heads, kv heads,
    ffn hidden) and every grid linear's features."""
    model_name = type(model).__name__
    sizes = {what: size for what, size in plan.tp.divides.items() if what not in _WHOLE}
    blocks = list(cast(nn.ModuleList, model.get_submodule(plan.blocks)))  # a plan's blocks module is a ModuleList
    for block in blocks[:1]:
        for name, style in plan.tp.block.items():
            if style in _LINEAR_STYLES and _has(block, name):
                linear = cast(nn.Linear, block.get_submodule(name))  # a linear style names an nn.Linear (_expect)
                sizes[f"{name} in_features"], sizes[f"{name} out_features"] = linear.in_features, linear.out_features
    for what, size in sizes.items():
        if size % q:
            per_q = {"2d": lambda n: n * n, "2.5d": lambda n: depth * n * n, "3d": lambda n: n**3}[mode]
            fits = [per_q(n) for n in range(2, 9) if size % n == 0]
            return (
                f"tp_mode={mode!r} on a grid of depth {depth} x {q} x {q} splits {what}={size} of"
                f" {model_name} into q={q} blocks, which does not divide it; use tp in {fits} (q dividing {size})"
            )
    return None


def check_grid_divides(model: nn.Module, plan: ParallelPlan, grid: TPGrid) -> None:
    problem = grid_divides_problem(model, plan, grid.mode, grid.depth, grid.q)
    if problem is not None:
        raise PlanError(problem)


def grid_plan_problem(model: nn.Module, plan: ParallelPlan, mode: str, depth: int, q: int) -> Optional[str]:
    """Why the grid of (depth, q, q) ranks cannot split `model` with this plan (None: it can)."""
    if plan.tp.unavailable:
        return f"tp_mode={mode!r}: {plan.tp.unavailable}"
    if tied_parameters(model):
        return (
            f"tp_mode={mode!r} with {type(model).__name__}'s tied parameters: the embedding is split over the hidden"
            " dim and the head replicated, so one matrix cannot be both; untie them (zoo GPT: tie_embeddings=False)"
        )
    return grid_divides_problem(model, plan, mode, depth, q)


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def apply_tensor_grid(model: nn.Module, plan: ParallelPlan, grid: TPGrid, scheme: GridScheme) -> None:
    """Replace `model`'s planned modules by the grid scheme's (see the module doc)."""
    model_name = type(model).__name__
    problem = grid_plan_problem(model, plan, grid.mode, grid.depth, grid.q)  # MeshStrategy refuses it earlier
    if problem is not None:  # ("tp_grid_fits_plan", grid/rules.py)
        raise PlanError(problem)
    layout = scheme.layout(grid)
    targets = [(model, name, style) for name, style in plan.tp.root.items()]
    for block in cast(nn.ModuleList, model.get_submodule(plan.blocks)):  # a plan's blocks module is a ModuleList
        targets += [(block, name, style) for name, style in plan.tp.block.items() if _has(block, name)]
    for owner, name, style in targets:
        if style in _NO_OP_STYLES or not _has(owner, name):
            continue
        module = owner.get_submodule(name)
        if style in _LINEAR_STYLES:
            _expect(module, nn.Linear, name, style, model_name)
            _replace(owner, name, lambda m: scheme.linear(m, grid, style))  # noqa: B023 - called at once
        elif style == "norm":
            _expect(module, nn.RMSNorm, name, style, model_name)
            _replace(owner, name, lambda m: GridRMSNorm(m, grid, layout))
        elif style in ("embedding", "embedding_whole_output"):
            _expect(module, nn.Embedding, name, style, model_name)
            _replace(owner, name, lambda m: GridEmbedding(m, grid, layout))
        elif style in ("head", "vocab_head"):
            _expect(module, nn.Linear, name, style, model_name)
            _replace(owner, name, lambda m: GridHead(m, grid, layout))
        else:
            raise PlanError(f"{model_name}: the TP style {style!r} of {name} has no grid form; use tp_mode='1d'")
    left = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if left:
        raise PlanError(
            f"tp_mode={grid.mode!r}: {model_name}'s parameters {left[:4]} are outside its TensorPlan, so the grid"
            " would run them on blocks of the activations with no rule for their gradients; name their modules in"
            " the plan, or use tp_mode='1d'"
        )


def average_over_replicas(owners: list[Any], group: dist.ProcessGroup) -> None:
    """DDP next to the grid (dp_replicate > 1): each gradient, once accumulated, is averaged over the replicas (each
    replica read other samples). FSDP2, which runs lit-mesh's other data parallelism, does not take the grid's
    DTensors. Under gradient accumulation each micro-batch's backward averages again: the mean of a mean is itself.
    The hooks are put on at each forward: materialising a meta model (lit_mesh/init.py) replaces the Parameters."""
    size = dist.get_world_size(group)

    def average(param: Tensor) -> None:
        with torch.no_grad():
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            assert grad is not None, "a post-accumulate-grad hook runs once the gradient is accumulated"
            dist.all_reduce(grad, group=group)
            grad.div_(size)

    def hook_parameters(module: nn.Module, _args: Any) -> None:
        for param in module.parameters():
            if param.requires_grad and not getattr(param, "_averaged_over_replicas", False):
                param.register_post_accumulate_grad_hook(average)
                param._averaged_over_replicas = True  # type: ignore[attr-defined]

    for owner in owners:
        owner.module.register_forward_pre_hook(hook_parameters)


def parallelize_grid(owners: list[Any], mesh: MeshViews, tp_mode: str, tp_depth: Optional[int]) -> TPGrid:
    """Build the grid of this run's tp ranks and apply every plan owner's TensorPlan on it (from apply.py)."""
    shape = grid_shape(mesh.layout.tp, tp_mode, tp_depth)
    assert shape is not None, "grid/rules.py (tp_grid_shape) refuses tp sizes that do not fit the grid"
    grid = build_grid(mesh.root, tp_mode, *shape)
    for owner in owners:
        apply_tensor_grid(owner.module, owner.plan, grid, SCHEMES[tp_mode])
    return grid
