"""Expert parallelism: a plan's MoE layers get an all-to-all dispatcher, their experts are split over `ep`.

ep borrows the innermost ranks of dp_shard x cp (see lit_mesh/mesh.py): the ranks of one ep group read
different batches, send each token to the rank that holds its expert, and get the results back. What changes
on an MoE layer (the plan's `moe.layer` in a block):
- `dispatcher`: `AllToAllDispatch` sums the load over dp x cp (the auxiliary loss and the balancing bias use
  global statistics, identical on every rank) and, with ep > 1, moves tokens with variable-split all-to-alls:
  token counts first, then the tokens, the experts' outputs back the same way;
- `experts`: the stacked weights become DTensors sharded over ep by expert (dim 0), then FSDP-sharded over the
  remaining ranks (`expert_dp`) by their dim 1 (dim 2 where tp holds dim 1), before the blocks are wrapped.

Expert tensor parallel (tp > 1 and a plan with `moe.hidden_dims`; torchtitan's etp, Megatron's ETP): each expert's
hidden units are split over tp as well (w1/w3 by output, w2 by input), so each tp rank does 1/tp of the expert
FLOPs. The tokens are replicated over tp (the MoE layer runs on the whole sequence, routed alike on every tp
rank); the dispatcher sums the tp ranks' partial outputs, and in backward the tokens' partial gradients.
Routing, the load statistics and the all-to-alls (over ep, within one tp index) are those of replicated experts.

Whole experts under tp (`expert_tp=1`; Megatron-Core's ETP 1 with MoE parallel folding): the MoE layer takes
this tp rank's sequence shard as it is (TP style "sequence_shard": no gather), its router and shared experts run on
those tokens with their weights replicated over tp (the plan's `moe.token_wise`, TP style "token_wise": gradients
summed over tp), and the all-to-alls carry only this rank's tokens. The experts are whole, split over ep, which takes
the innermost ranks of dp_shard x cp x tp (a tp group first; ep may exceed dp_shard x cp), and FSDP-sharded over the
rest (lit_mesh.mesh.folded_expert_meshes), which sums their gradients over every rank's tokens; the load sums over
dp x cp x tp, and the aux loss's mean router probabilities are averaged over tp in forward (Megatron's g: the
backward hands each rank its share), so every tp rank holds the same aux loss. Per tp rank: 1/tp of the routed
tokens, whole experts.

Gradients: a rank's experts see the tokens of all ep ranks, so their gradient is the sum of ep ranks'
contributions, while FSDP averages only over expert_dp (world / ep ranks): the expert weights' gradient is
scaled by 1/ep inside the dispatch (tp / ep with whole experts under tp: FSDP averages over tp x as many ranks), the
gradient of the tokens is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from lit_mesh.comm.topology import Topology
from lit_mesh.errors import MeshConfigError
from lit_mesh.mesh import MeshAxis, MeshLayout, MeshViews, ep_borrowing_problem, folded_expert_meshes
from lit_mesh.parallel.data import mixed_precision_policy, reshards_after_forward
from lit_mesh.parallel.expert_by_node import EP_DISPATCHES, ByNodeDispatch, EPDispatch, ep_dispatch_problem, node_groups
from lit_mesh.parallel.expert_combine import combine_expert_outputs, weighted_sum_per_token
from lit_mesh.parallel.expert_counts import exchange_counts
from lit_mesh.plan import MoEPlan, ParallelPlan, PlanError
from lit_mesh.unit import Facts, Rule, divisors, option


@dataclass(frozen=True)
class ExpertOptions:
    """The expert-parallel unit's options (MeshStrategy's expert_tp); the degree ep belongs to the mesh."""

    tp: Optional[int] = option(
        None,
        doc="how the tp ranks share the experts of the plan's MoE layers: None (or tp) splits each expert's hidden"
        " units over tp and routes the whole sequence on every tp rank (the default); 1 keeps every expert whole and"
        " routes each tp rank's own sequence shard (Megatron-Core's ETP 1, MoE parallel folding: 1/tp of the"
        " all-to-all bytes and routed activations per rank; the expert weights are FSDP-sharded over dp_shard x cp x"
        " tp / ep). 1 needs sequence_parallel and a dropless plan that declares MoEPlan.token_wise (the zoo MoE does).",
        arg="expert_tp",
    )

    dispatch: EPDispatch = option(
        "all_to_all",
        doc="how tokens reach their experts' ranks: 'all_to_all' sends every routed copy to its expert's rank;"
        " 'by_node' (DeepEP's inter-node scheme) sends a token once to each node that holds one of its experts and"
        " forwards it to the experts' ranks inside that node: fewer bytes between nodes where an ep group spans"
        " nodes (the same as 'all_to_all' inside one node). Nodes are the run's (topology=Topology(nodes=...) splits"
        " one machine into simulated ones).",
        arg="ep_dispatch",
    )

    def __post_init__(self) -> None:
        if self.dispatch not in EP_DISPATCHES:
            raise MeshConfigError(
                f"ep_dispatch={self.dispatch!r} is not one of {list(EP_DISPATCHES)}; use 'all_to_all' (every routed"
                " copy to its expert's rank) or 'by_node' (once per destination node, forwarded inside the node)"
            )
        if self.tp is not None and (isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1):
            raise MeshConfigError(
                f"expert_tp={self.tp!r} must be None (tp: experts split over tp) or 1 (whole experts, each tp rank"
                " routing its sequence shard)"
            )


def folds_experts(layout: MeshLayout, options: ExpertOptions) -> bool:
    """Whole experts under tp: each tp rank routes its own sequence shard (expert_tp=1 with tp > 1)."""
    return layout.tp > 1 and options.tp == 1


class MoELayer(nn.Module):
    """A plan's MoE layer as expert parallel uses it (see MoEPlan.layer): a type only, the layers are the
    model's own classes (`moe_layers` casts to it)."""

    experts: nn.Module  # stacked weights, experts first
    dispatcher: Any  # LocalDispatch-like: swapped for AllToAllDispatch


def moe_layers(model: nn.Module, plan: ParallelPlan) -> Iterator[MoELayer]:
    """The MoE layers of the plan's blocks (blocks without `plan.moe.layer` are dense)."""
    if plan.moe is None:
        return
    for block in cast(nn.ModuleList, model.get_submodule(plan.blocks)):
        layer = getattr(block, plan.moe.layer, None)
        if isinstance(layer, nn.Module):
            yield cast(MoELayer, layer)


def adapt_moe_layers(model: nn.Module, plan: ParallelPlan) -> None:
    """The plan's MoE adapter on every MoE layer (before any technique: all layouts then compute alike)."""
    if plan.moe is not None and plan.moe.adapter is not None:
        for layer in moe_layers(model, plan):
            plan.moe.adapter(layer)


def expert_modules(model: nn.Module, plan: ParallelPlan) -> list[nn.Module]:
    """The stacked-weight expert modules (kept out of TP's replication: they are placed here)."""
    return [layer.experts for layer in moe_layers(model, plan)]


def ep_divides_problem(plan: ParallelPlan, ep: int, model_name: str) -> Optional[str]:
    """Which size of the MoE layers `ep` does not divide (None: it divides every size the plan names)."""
    for what, size in (plan.moe.ep_divides if plan.moe is not None else {}).items():
        if size % ep:
            return f"ep={ep} does not divide {what}={size} of {model_name} (choose ep in {divisors(size)})"
    return None


def ep_plan_problem(model: nn.Module, plan: ParallelPlan, ep: int) -> Optional[str]:
    """Why `ep` ranks cannot split the experts of a model with this plan (None: they can)."""
    model_name = type(model).__name__
    if next(moe_layers(model, plan), None) is None:
        return (
            None
            if ep == 1
            else (
                f"ep={ep} but {model_name}.parallel_plan() declares no MoE layer (ParallelPlan.moe); use ep=1 for a"
                " dense model"
            )
        )
    return ep_divides_problem(plan, ep, model_name)


def check_ep_divides(plan: ParallelPlan, ep: int, model_name: str) -> None:
    problem = ep_divides_problem(plan, ep, model_name)
    if problem is not None:
        raise PlanError(problem)


def _plan_problems(f: Facts) -> list[str]:
    problems = (ep_plan_problem(o.module, o.plan, f.layout.ep) for o in f.owners)
    return [problem for problem in problems if problem is not None]


def fold_plan_problem(model: nn.Module, plan: ParallelPlan) -> Optional[str]:
    """Why the MoE layers of a model with this plan cannot route each tp rank's sequence shard (None: they can)."""
    model_name = type(model).__name__
    layer = next(moe_layers(model, plan), None)
    if layer is None:
        return None  # a dense model: nothing to fold
    assert plan.moe is not None
    if getattr(layer, "capacity_factor", None) is not None:
        return (
            f"expert_tp=1 with {model_name}'s capacity_factor={layer.capacity_factor}: capacity counts per sequence,"
            " which the tp ranks split; use capacity_factor=None (dropless), or expert_tp=None"
        )
    owned = {id(p) for p in layer.experts.parameters()}
    for name in plan.moe.token_wise:
        owned |= {id(p) for p in layer.get_submodule(name).parameters()}
    stray = [name for name, p in layer.named_parameters() if id(p) not in owned]
    if stray:
        return (
            f"expert_tp=1 with {model_name}: the parameters {stray} of its MoE layer {plan.moe.layer!r} lie outside"
            " `experts` and outside MoEPlan.token_wise, so their gradients would miss the other tp ranks' tokens;"
            " name the modules that hold them in MoEPlan.token_wise (applied token by token), or use expert_tp=None"
        )
    return None


def _fold_problems(f: Facts) -> list[str]:
    if not folds_experts(f.layout, f.options.expert):
        return []
    problems = (fold_plan_problem(o.module, o.plan) for o in f.owners)
    return [problem for problem in problems if problem is not None]


def _by_node_problem(f: Facts) -> Optional[str]:
    return ep_dispatch_problem(f.layout, folds_experts(f.layout, f.options.expert), f.topology)


RULES: list[Rule] = [
    Rule(
        "expert_tp_is_1_or_tp",
        "launch",
        lambda f: f.options.expert.tp not in (None, 1, f.layout.tp),
        lambda f: (
            f"expert_tp={f.options.expert.tp} with tp={f.layout.tp}: the experts are either split over all tp ranks"
            " (expert_tp=None, or tp) or whole on each (expert_tp=1)"
        ),
    ),
    Rule(
        "ep_needs_whole_experts",
        "launch",
        lambda f: (
            (f.layout.dp_shard * f.layout.cp) % f.layout.ep != 0 and not folds_experts(f.layout, f.options.expert)
        ),
        lambda f: ep_borrowing_problem(f.layout),
    ),
    Rule(
        "expert_tp_1_needs_sequence_parallel",
        "launch",
        lambda f: folds_experts(f.layout, f.options.expert) and not f.options.mesh.sequence_parallel,
        lambda f: (
            f"expert_tp=1 with tp={f.layout.tp} routes each tp rank's shard of the sequence, which only"
            " sequence_parallel makes; use sequence_parallel=True (tp_mode='1d'), or expert_tp=None"
        ),
    ),
    Rule(
        "ep_dispatch_by_node_fits_topology",
        "launch",
        lambda f: f.options.expert.dispatch == "by_node" and bool(_by_node_problem(f)),
        lambda f: _by_node_problem(f) or "",
    ),
    Rule(
        "expert_tp_1_fits_plan",
        "setup",
        lambda f: not f.self_parallelised and bool(_fold_problems(f)),
        lambda f: _fold_problems(f)[0],
        PlanError,
    ),
    Rule(
        "ep_fits_plan",
        "setup",
        lambda f: not f.self_parallelised and f.layout.ep > 1 and bool(_plan_problems(f)),
        lambda f: _plan_problems(f)[0],
        PlanError,
    ),
]


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def copy_to_tp(tokens: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the tp ranks' partial gradients (Megatron's f, as torch's ColwiseParallel)."""
    return DTensor.from_local(tokens, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def sum_over_tp(partial: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """All-reduce forward; backward hands the (replicated) gradient to every rank (Megatron's g)."""
    return (
        DTensor.from_local(partial, tp_mesh, [Partial()], run_check=False)
        .redistribute(placements=[Replicate()])
        .to_local()
    )


MOE_SPLIT_SIZES = "moe all-to-all split sizes"


def split_sizes(on_host: torch.Tensor) -> tuple[list[int], list[int]]:
    """The tokens this rank sends to / receives from each ep rank, as host integers (the variable-split
    all-to-alls need them so), from exchange_counts' host copy (2, ep, local experts)."""
    send, recv = ([sum(row) for row in counts] for counts in on_host.tolist())  # read on the host as it is
    return send, recv


class AllToAllDispatch:
    """Global load over `load_group`; tokens to their experts' ranks over `ep_group` (None: ep = 1); each expert's
    hidden units split over `tp_mesh` (None: whole experts on this rank); `token_tp_mesh`: the tp ranks whose
    sequence shards reach the same whole experts (expert_tp=1; None: the tp ranks route the same tokens).

    Host reads: with ep > 1 one per MoE layer and forward (`counts_on_host`: the all-to-alls' split sizes are
    host integers; not again in selective AC's recompute, lit_mesh/parallel/expert_counts.py), none with ep = 1;
    the experts get their token counts on the device. The load statistics are reduced once per step for all layers
    (`reduces_load_later`: the model sums them in its aux_loss()).
    """

    reduces_load_later = True

    def __init__(
        self,
        n_experts: int,
        load_group: dist.ProcessGroup,
        ep_group: dist.ProcessGroup | None,
        tp_mesh: DeviceMesh | None = None,
        token_tp_mesh: DeviceMesh | None = None,
        experts_seen_by: int | None = None,
    ) -> None:
        self.n_experts = n_experts
        self.load_group = load_group
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.tp_mesh = tp_mesh
        self.tp = tp_mesh.size() if tp_mesh is not None else 1
        self.token_tp_mesh = token_tp_mesh
        # the expert weights' gradient: FSDP averages over expert_dp = world / ep ranks (x tp with whole experts);
        # `experts_seen_by`: the ep ranks whose tokens reach these experts where that is more than this group's
        # (by node: the whole ep group, this dispatch its node's part)
        self.weight_gradient_scale = (token_tp_mesh.size() if token_tp_mesh is not None else 1) / (
            experts_seen_by or self.ep
        )

    def mean_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """The mean router probabilities (N, E) -> (E,) the aux loss weighs: with whole experts under tp, over the
        tp ranks' sequence shards (equal token counts), so that every tp rank holds the same aux loss."""
        mean = probs.mean(dim=0)
        if self.token_tp_mesh is None:
            return mean
        return sum_over_tp(mean, self.token_tp_mesh) / self.token_tp_mesh.size()

    def run_experts(self, experts: nn.Module, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.tp_mesh is None:
            return experts(tokens, tokens_per_expert)
        return sum_over_tp(experts(copy_to_tp(tokens, self.tp_mesh), tokens_per_expert), self.tp_mesh)

    def global_load(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        load = tokens_per_expert.clone()
        dist.all_reduce(load, group=self.load_group)
        return load

    def combine(
        self,
        experts: nn.Module,
        tokens: torch.Tensor,
        token_index: torch.Tensor,
        weights: torch.Tensor,
        tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        """Each token's weighted sum of its experts' outputs (N, dim): assignment i sends tokens[token_index[i]] to
        its expert (assignments grouped by global expert id, tokens_per_expert of each) with weight weights[i]."""
        if self.ep_group is None:
            scale = self.weight_gradient_scale
            if scale == 1:
                out = self.run_experts(experts, tokens[token_index], tokens_per_expert)
            else:  # the weights' gradient x scale, the tokens' gradient unchanged
                out = self.run_experts(
                    experts, _ScaleGradient.apply(tokens[token_index], 1.0 / scale), tokens_per_expert
                )
                out = _ScaleGradient.apply(out, scale)
            return weighted_sum_per_token(tokens, token_index, out, weights)
        ep, local_experts = self.ep, self.n_experts // self.ep
        # 1. counts: row r = how many tokens this rank sends to each expert of rank r, and receives back
        send_counts = tokens_per_expert.view(ep, local_experts)
        recv_counts, on_host = exchange_counts(send_counts, self.ep_group.group_name)  # kept by selective AC
        send_splits, recv_splits = split_sizes(on_host)
        per_local_expert = recv_counts.sum(0)  # on the device: the experts' grouped GEMMs take device offsets
        # 2. tokens, each with its router weight as one more column, in one all-to-all; the weight in the tokens'
        # dtype: the weighting casts it to the experts' output dtype, never wider than the tokens' (the same product)
        sent = torch.cat([tokens[token_index], weights[:, None].to(tokens.dtype)], dim=1)
        received = all_to_all_single_autograd(sent, recv_splits, send_splits, group=self.ep_group)
        # split, not sliced: its backward concatenates the two gradients (two slices would each fill a whole-size one)
        received_tokens, received_weights = received.split([tokens.shape[1], 1], dim=1)
        # they arrive grouped by (source rank, local expert): regroup by local expert
        source_expert = torch.arange(ep * local_experts, device=tokens.device).repeat_interleave(
            recv_counts.flatten(),
            output_size=sum(recv_splits),  # the size known on the host: no device read
        )
        by_expert = torch.argsort(source_expert % local_experts * ep + source_expert // local_experts, stable=True)
        grouped = _ScaleGradient.apply(received_tokens[by_expert], 1.0 / self.weight_gradient_scale)
        out = self.run_experts(experts, grouped, per_local_expert)
        # the weights' gradient x 1/ep (tp/ep with whole experts under tp); the tokens' gradient unchanged
        out = _ScaleGradient.apply(out, self.weight_gradient_scale)
        # 3. weighted here (the router's gradient comes back with the weights), back to the ranks the tokens came
        # from in the order they were sent, summed per token (lit_mesh/parallel/expert_combine.py)
        back = out[torch.argsort(by_expert)]
        weighted = back * received_weights.to(back.dtype)
        group_name = self.ep_group.group_name
        return combine_expert_outputs(weighted, token_index, tokens.shape[0], send_splits, recv_splits, group_name)


def expert_tensor_parallel(plan: ParallelPlan, layout: MeshLayout, fold: bool = False) -> bool:
    """Whether the experts' hidden units are split over tp (else the experts are whole on every tp rank)."""
    return layout.tp > 1 and plan.moe is not None and bool(plan.moe.hidden_dims) and not fold


def sequence_sharded_moe_plan(model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
    """The plan with whole experts under tp (expert_tp=1): its MoE layer takes the sequence shard as it is, the
    modules it applies per token (MoEPlan.token_wise) run on this rank's tokens with replicated weights: each module
    inside them that holds parameters (torch's SequenceParallel replicates a module's own parameters only)."""
    layer = next(moe_layers(model, plan), None)
    if plan.moe is None or layer is None:
        return plan
    block = dict(plan.tp.block)
    block[plan.moe.layer] = "sequence_shard"
    for name in plan.moe.token_wise:
        for inner, module in layer.get_submodule(name).named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                block[".".join(filter(None, (plan.moe.layer, name, inner)))] = "token_wise"
    return replace(plan, tp=replace(plan.tp, block=block))


def moe_load_group(mesh: MeshViews, fold: bool) -> dist.ProcessGroup:
    """The ranks whose routed tokens make the global load: dp x cp, and tp with whole experts under tp."""
    return folded_expert_meshes(mesh).dp_cp_tp.get_group() if fold else mesh.dp_cp.get_group()


def expert_tp_placement(moe: MoEPlan, name: str, model_name: str) -> Placement:
    """How expert tensor parallel splits the stacked weight `name` over tp: by its hidden dim."""
    if name not in moe.hidden_dims:
        raise PlanError(
            f"{model_name}.parallel_plan(): expert weight {name!r} has no hidden dim in MoEPlan.hidden_dims"
            f" {dict(moe.hidden_dims)}; name the dim of each expert weight that runs over the hidden units"
        )
    dim = moe.hidden_dims[name]
    # a [gate; up] stack: slice each half (torch has no public placement for it; FSDP2 uses _StridedShard so too)
    return _StridedShard(dim, split_factor=2) if name in moe.packed else Shard(dim)


def apply_expert_parallel(
    model: nn.Module,
    plan: ParallelPlan,
    mesh: MeshViews,
    layout: MeshLayout,
    fold: bool = False,
    by_node: Optional[Topology] = None,
) -> None:
    """Swap the dispatcher of every MoE layer and split the stacked expert weights over ep (dim 0), and with
    expert tensor parallel over tp (their hidden dim) too; `fold`: whole experts, each tp rank routing its own
    sequence shard (expert_tp=1); `by_node`: the run's topology under ep_dispatch="by_node" (two-stage dispatch where
    an ep group spans nodes, lit_mesh/parallel/expert_by_node.py)."""
    problem = ep_plan_problem(model, plan, layout.ep)  # MeshStrategy refuses it earlier ("ep_fits_plan")
    problem = problem or (fold_plan_problem(model, plan) if fold else None)  # and "expert_tp_1_fits_plan"
    if problem is not None:
        raise PlanError(problem)
    layers = list(moe_layers(model, plan))
    if not layers:
        return
    ep_mesh = folded_expert_meshes(mesh).ep if fold else mesh.ep
    ep_group = ep_mesh.get_group() if layout.ep > 1 else None
    load_group = moe_load_group(mesh, fold)
    tp_mesh = mesh[MeshAxis.TP] if expert_tensor_parallel(plan, layout, fold) else None
    token_tp_mesh = mesh[MeshAxis.TP] if fold else None
    weights_mesh = ep_mesh if tp_mesh is None else DeviceMesh._concatenate([ep_mesh, tp_mesh])  # (ep, tp), as FSDP2
    split = node_groups(mesh.root, layout, fold, by_node, ep_group) if by_node is not None and ep_group else None
    assert plan.moe is not None  # the layers are plan.moe's
    for layer in layers:
        n_experts = next(layer.experts.parameters()).shape[0]  # stacked weights: experts first
        layer.dispatcher = AllToAllDispatch(n_experts, load_group, ep_group, tp_mesh, token_tp_mesh)
        if split is not None:  # the ep group spans nodes: each node's share of it dispatches inside the node
            inter, intra = split
            nodes = dist.get_world_size(inter)
            within_node = AllToAllDispatch(n_experts // nodes, load_group, intra, tp_mesh, token_tp_mesh, layout.ep)
            layer.dispatcher = ByNodeDispatch(inter, within_node)
        if getattr(layer, "capacity_factor", None) is not None and layout.cp > 1:
            raise PlanError(
                f"capacity_factor={layer.capacity_factor} counts capacity per sequence, which cp={layout.cp} splits;"
                " use capacity_factor=None (dropless) with context parallel"
            )
        if layout.tp == 1 and layout.data_parallel == "none":
            continue  # pp alone: no other parameter becomes a DTensor, and AdamW's foreach cannot mix the two
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            placements = (
                [Shard(0)] if tp_mesh is None else [Shard(0), expert_tp_placement(plan.moe, name, type(model).__name__)]
            )
            sharded = distribute_tensor(param.data, weights_mesh, placements, src_data_rank=None)
            layer.experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def expert_data_parallel_mesh(mesh: MeshViews, layout: MeshLayout, fold: bool = False) -> DeviceMesh | None:
    """FSDP2's mesh for the expert weights: 1D efsdp to shard, 2D (edp_replicate, efsdp) to replicate too; with
    whole experts under tp (`fold`) the efsdp of dp_shard x cp x tp, also without data parallel (it sums their
    gradients over the tp ranks)."""
    if fold:
        return folded_expert_meshes(mesh).expert_dp
    if layout.data_parallel == "none":
        return None
    return mesh.expert_dp[MeshAxis.EFSDP] if layout.dp_replicate == 1 else mesh.expert_dp


def shard_experts(
    model: nn.Module,
    plan: ParallelPlan,
    mesh: MeshViews,
    layout: MeshLayout,
    precision: str,
    zero_stage: int = 3,
    fold: bool = False,
) -> None:
    """fully_shard each MoE layer's experts over expert_dp (x tp with `fold`), before the blocks (their own FSDP
    units).

    Dim 1 (dim 2 where expert tensor parallel splits dim 1): dim 0 is already split over ep, and there may be
    fewer local experts than expert_dp ranks.
    """
    expert_mesh = expert_data_parallel_mesh(mesh, layout, fold)
    if expert_mesh is None:
        return
    shards = expert_mesh.size(expert_mesh.ndim - 1)  # efsdp: (edp_replicate, efsdp) or efsdp alone
    for experts in expert_modules(model, plan):
        _check_even_shards(experts, shards, layout, fold)
        fully_shard(
            experts,
            mesh=expert_mesh,
            mp_policy=mixed_precision_policy(precision),
            reshard_after_forward=reshards_after_forward(layout, zero_stage),
            shard_placement_fn=lambda param: Shard(fsdp_dim(param)),
        )


def fsdp_dim(param: torch.Tensor) -> int:
    """The dim FSDP2 shards an expert weight by: 1, or 2 where tp splits dim 1 (no FSDP shard inside a tp shard)."""
    tp_dims = {getattr(p, "dim", None) for p in param.placements[1:]} if isinstance(param, DTensor) else set()
    return 2 if 1 in tp_dims else 1


def _check_even_shards(experts: nn.Module, shards: int, layout: MeshLayout, fold: bool) -> None:
    # FSDP2 cannot shard a dim other than 0 unevenly (NotImplementedError deep in setup): say why, with the fix
    params = dict(experts.named_parameters(recurse=False))
    for name, param in params.items():
        dim = fsdp_dim(param)
        if param.shape[dim] % shards:
            ranks = layout.dp_shard * layout.cp * (layout.tp if fold else 1)  # what ep borrows from
            fits = [
                ep
                for ep in range(1, ranks + 1)
                if ranks % ep == 0
                and param.shape[0] % ep == 0
                and all(p.shape[fsdp_dim(p)] % (ranks // ep) == 0 for p in params.values())
            ]
            over = f"dp_shard x cp / ep = {layout.dp_shard} x {layout.cp} / {layout.ep}"
            if fold:  # whole experts under tp
                over = f"dp_shard x cp x tp / ep = {layout.dp_shard} x {layout.cp} x {layout.tp} / {layout.ep}"
            raise PlanError(
                f"expert weight {name!r} {tuple(param.shape)} is FSDP-sharded by its dim {dim} ({param.shape[dim]}) over"
                f" {over} = {shards} ranks, which does not divide it; choose "
                + (f"ep in {fits}, or " if fits else "")
                + f"expert sizes divisible by {shards}"
            )
