"""The parameters of a model family's network (the zoo GPT or MoE, or a registered one: lit_mesh.planner.families) by
role, read from a one-block model on the meta device and its ParallelPlan (the TP style of each module is the plan's,
so the planner shards exactly what lit_mesh.parallel shards)."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from lit_mesh.plan import ParallelPlan

import torch
from torch import nn

from lit_mesh.planner.families import family_of


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    tp_style: str | None  # the plan's style of the module holding it (None: replicated over tp)
    is_embedding: bool  # an nn.Embedding weight (RowwiseParallel shards its rows, a Linear's columns)
    expert: bool = False  # a stacked expert weight (E, ...): split over ep by expert, FSDP over expert_dp by dim 1
    hidden_dim: int | None = None  # an expert weight's hidden dim: expert tensor parallel splits it over tp
    # expert_tp=1: whole on every tp rank, split over ep (the innermost ranks of dp_shard x cp x tp), FSDP over the rest
    whole_under_tp: bool = False
    token_wise: bool = False  # in a module of MoEPlan.token_wise (router, shared experts): replicated over tp there


@dataclass(frozen=True)
class ModelShapes:
    config: Any  # the family's config (the zoo's GPTConfig or MoEConfig)
    block: tuple[ParamShape, ...]  # one block's parameters; every block has the same
    first: tuple[ParamShape, ...]  # before the blocks (the first pipeline stage holds them)
    last: tuple[ParamShape, ...]  # after the blocks (the last stage)
    tp_divides: dict[str, int]
    ep_divides: dict[str, int] = field(default_factory=dict)  # empty: a dense model (ep must stay 1)
    # MeshStrategy(ep_dispatch="by_node"): the nodes an ep group spans, each token sent once per destination node
    # and forwarded inside it (lit_mesh/parallel/expert_by_node.py); 1: the all-to-all dispatch
    ep_nodes: int = 1
    # how unevenly the trained router spreads one sequence's routed copies over the experts: the coefficient of
    # variation of an expert's share of them (0: balanced routing, as forced balance or a capacity factor makes it;
    # the planner's default); a dropless run's busiest ep rank then receives more than its share (routing_imbalance)
    routing_cv: float = 0.0

    @property
    def n_blocks(self) -> int:
        return self.config.n_layers

    @property
    def is_moe(self) -> bool:
        return bool(self.ep_divides)

    # cached: the search asks these of every option it prices
    @functools.cached_property
    def expert_tp(self) -> bool:
        """tp > 1 splits each routed expert's hidden units over tp (MoEPlan.hidden_dims)."""
        return any(p.hidden_dim is not None for p in self.block if p.expert)

    @functools.cached_property
    def dense_block(self) -> tuple[ParamShape, ...]:
        """A block's parameters outside the stacked experts."""
        return tuple(p for p in self.block if not p.expert)

    @functools.cached_property
    def expert_block(self) -> tuple[ParamShape, ...]:
        """A block's stacked expert weights."""
        return tuple(p for p in self.block if p.expert)

    @functools.cached_property
    def first_row_parallel(self) -> tuple[ParamShape, ...]:
        """A block's first row-parallel weight (attention's output projection), alone in a tuple."""
        return tuple(p for p in self.block if p.tp_style == "rowwise")[:1]

    @functools.cached_property
    def whole_experts(self) -> bool:
        """expert_tp=1: whole experts under tp, each tp rank routing its own sequence shard (MoE parallel folding)."""
        return any(p.whole_under_tp for p in self.block)

    def with_whole_experts(self) -> ModelShapes:
        """These shapes under MeshStrategy(expert_tp=1) (lit_mesh/parallel/expert.py); made once per shapes."""
        return self if self.whole_experts else self._whole

    @functools.cached_property
    def _whole(self) -> ModelShapes:
        block = tuple(
            dataclasses.replace(p, hidden_dim=None, whole_under_tp=True) if p.expert else p for p in self.block
        )
        return dataclasses.replace(self, block=block)

    def with_ep_nodes(self, nodes: int) -> ModelShapes:
        """These shapes under MeshStrategy(ep_dispatch="by_node") with ep groups over `nodes` nodes (made once per
        count: the planner's caches key on the shapes' identity)."""
        if nodes == self.ep_nodes:
            return self
        if nodes not in self._by_nodes:
            self._by_nodes[nodes] = dataclasses.replace(self, ep_nodes=nodes)
        return self._by_nodes[nodes]

    def with_routing_cv(self, cv: float) -> ModelShapes:
        """These shapes with a router that spreads a sequence's tokens over the experts with this unevenness."""
        return self if cv == self.routing_cv else dataclasses.replace(self, routing_cv=cv)

    def routing_imbalance(self, ep: int, tp: int, cp: int, micro_batch: int) -> float:
        """The busiest ep rank's routed copies over the mean, per micro-batch, with routing_cv > 0 (dropless).

        A rank's load sums its n_experts / ep experts' shares of the sequences its ep group routes (ep x micro_batch
        / cp of them; with whole experts under tp each tp rank routes its own 1/tp): their spread shrinks as the
        square root of the (sequence, expert) pairs summed, and the busiest of ep ranks sits the expected maximum of ep
        normal draws above the mean. Parts of one sequence route alike, so fewer than one count as one. Time only:
        which rank is busiest changes with the layer and the micro-batch, so what a rank holds for backward, summed
        over them, stays near its share (as the published TP 4 x PP 8 run without recompute, which fits in 80 GB)."""
        if self.routing_cv == 0 or ep == 1 or not self.is_moe:
            return 1.0
        sequences = max(1.0, ep * micro_batch / (cp * (tp if self.whole_experts else 1)))
        experts = self.config.n_experts / ep
        return 1.0 + expected_maximum_of_normals(ep) * self.routing_cv / math.sqrt(sequences * experts)

    @functools.cached_property
    def nodes_per_token(self) -> float:
        """Under ep_dispatch="by_node": the nodes a token's top_k experts sit on, on average, with routing uniform
        over the experts (as the planner assumes everywhere; under group-limited routing uniform over the groups,
        then over their experts): ep_nodes x P(a node holds one of them)."""
        c, nodes = self.config, self.ep_nodes
        if nodes == 1:
            return 1.0
        groups, best_groups = getattr(c, "n_groups", 1), getattr(c, "topk_groups", 1)
        if groups > 1 and groups % nodes == 0:  # group-limited routing, whole groups per node: the token's top_k
            # among the experts of its best_groups groups, j of them on a given node (hypergeometric)
            per_node, per_group = groups // nodes, c.n_experts // groups
            chosen = best_groups * per_group
            visited = sum(
                math.comb(per_node, j)
                * math.comb(groups - per_node, best_groups - j)
                / math.comb(groups, best_groups)
                * (1 - math.comb(chosen - j * per_group, c.top_k) / math.comb(chosen, c.top_k))
                for j in range(min(per_node, best_groups) + 1)
            )
            return nodes * visited
        per_node = c.n_experts // nodes
        none_there = math.prod((c.n_experts - per_node - i) / (c.n_experts - i) for i in range(c.top_k))
        return nodes * (1 - none_there)

    @functools.cached_property
    def _by_nodes(self) -> dict[int, ModelShapes]:
        return {}

    @property
    def tp_regions(self) -> int:
        """Regions of a block that gather their sequence-parallel input under tp (attention and the feed-forward; with
        whole experts the MoE layer takes its sequence shard as it is: attention alone)."""
        return 1 if self.whole_experts else 2

    def numel(self) -> int:
        count = lambda params: sum(_numel(p.shape) for p in params)  # noqa: E731
        return count(self.first) + count(self.last) + self.n_blocks * count(self.block)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_model(config: Any) -> nn.Module:
    """The network of a config, built by its model family (the zoo's: GPT for a GPTConfig, MoETransformer for an
    MoEConfig)."""
    return family_of(config).build(config)


class _Planned(Protocol):
    """The network a model family builds: it declares its ParallelPlan."""

    def parallel_plan(self) -> ParallelPlan: ...


def gpt_shapes(config: Any) -> ModelShapes:
    """The shapes of a GPTConfig's or an MoEConfig's model (every block alike: MoE needs moe_every = 1)."""
    if getattr(config, "moe_every", 1) != 1:
        raise ValueError(
            f"moe_every={config.moe_every}: the planner models identical blocks; plan MoE models with"
            " moe_every=1 (every block MoE)"
        )
    with torch.device("meta"):
        model = build_model(dataclasses.replace(config, n_layers=1))
    plan = cast(_Planned, model).parallel_plan()
    experts = f"{plan.blocks}.0.{plan.moe.layer}.experts." if plan.moe is not None else None
    token_wise = tuple(f"{plan.blocks}.0.{plan.moe.layer}.{m}." for m in plan.moe.token_wise) if plan.moe else ()
    modules = dict(model.named_modules())
    block, first, last = [], [], []
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        embedding = isinstance(modules[owner], torch.nn.Embedding)
        if name.startswith(f"{plan.blocks}.0."):
            local = owner[len(plan.blocks) + 3 :]
            expert = experts is not None and name.startswith(experts)  # TP leaves them to EP
            style = None if expert else plan.tp.block.get(local)
            hidden = plan.moe.hidden_dims.get(name.rsplit(".", 1)[1]) if expert else None  # type: ignore[union-attr]
            block.append(
                ParamShape(
                    name[len(plan.blocks) + 3 :],
                    tuple(p.shape),
                    style,
                    embedding,
                    expert,
                    hidden,
                    token_wise=bool(token_wise) and name.startswith(token_wise),
                )
            )
            continue
        child = name.split(".")[0]
        entry = ParamShape(name, tuple(p.shape), plan.tp.root.get(owner), embedding)
        if child in plan.pp.first or not (plan.pp.first or plan.pp.last):  # no pp split declared: one stage
            first.append(entry)
        elif child in plan.pp.last:
            last.append(entry)
        else:
            raise ValueError(f"{name}: neither in a block nor in the plan's pp.first / pp.last")
    ep_divides = dict(plan.moe.ep_divides) if plan.moe is not None else {}
    return ModelShapes(config, tuple(block), tuple(first), tuple(last), dict(plan.tp.divides), ep_divides)


@functools.cache
def expected_maximum_of_normals(n: int) -> float:
    """E[max of n independent standard normal draws] (1.42 for 8, 2.07 for 32): the integral of x n pdf(x)
    cdf(x)^(n-1) over [-8, 8] by the trapezoid rule."""
    normal, steps, low, high = statistics.NormalDist(), 4000, -8.0, 8.0
    width = (high - low) / steps
    xs = [low + i * width for i in range(steps + 1)]
    values = [x * n * normal.pdf(x) * normal.cdf(x) ** (n - 1) for x in xs]
    return width * (sum(values) - (values[0] + values[-1]) / 2)
