"""Node-aware expert dispatch (MeshStrategy(ep_dispatch="by_node"); DeepEP's inter-node scheme, on torch's
collectives): where an ep group spans nodes, each token crosses to another node once per destination node, not once
per routed copy, and is forwarded to its experts' ranks inside that node.

An ep group of n nodes x g ranks per node, its ranks node by node (ep rank = node x g + rank in node):
  1. between nodes (the n ranks with this rank's place in their node, one per node): each token once to every node
     that holds one of its experts, with a table of its assignments there (the row of its token in the block sent to
     that node, the expert among the node's, the router weight);
  2. inside the node (g ranks): the received tokens go to their experts as the all-to-all dispatch sends them (per
     routed copy, over the node's links), the experts run, and each copy comes back weighted and summed per received
     token: one partial sum per (token, node);
  3. between nodes again: the partial sums go home and are summed per token (lit_mesh::combine_expert_outputs).
What crosses nodes drops from top_k copies of a token to the number of nodes its experts sit on (with top_k = 8 of
128 experts on 4 nodes, 3.6 rows on average instead of 8, of which (n - 1) / n leave the node). The sums run in
another order than the all-to-all dispatch's: the same curve within float rounding, not bit for bit.

Host reads: two per MoE layer and forward (the split sizes of both stages; kept by selective AC like the all-to-all
dispatch's, lit_mesh/parallel/expert_counts.py); none in between.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from lit_mesh.comm.hierarchical import split_by_node
from lit_mesh.comm.topology import Topology
from lit_mesh.mesh import MESH_AXES, MeshLayout, group_pool
from lit_mesh.parallel.expert_combine import combine_expert_outputs
from lit_mesh.parallel.expert_counts import exchange_counts

EPDispatch = Literal["all_to_all", "by_node"]
EP_DISPATCHES: tuple[str, ...] = get_args(EPDispatch)
# the table's integer columns travel as float32 with the router weight (exact below 2**24)
_EXACT_IN_FLOAT32 = 2**24


def expert_parallel_groups(layout: MeshLayout, fold: bool) -> list[list[int]]:
    """Every ep group's global ranks in ep order, as lit_mesh.mesh builds them: ep takes the innermost ranks of
    dp x cp (of dp x cp x tp with whole experts under tp, `fold`), for each pp stage (and each tp rank)."""
    ranks = torch.arange(layout.world_size).view(*(getattr(layout, axis) for axis in MESH_AXES))
    # (pp, dp_replicate, dp_shard, cp, tp): the ranks that route alike, innermost last
    routed = ranks.reshape(layout.pp, -1) if fold else ranks.permute(0, 4, 1, 2, 3).reshape(layout.pp * layout.tp, -1)
    return routed.reshape(-1, layout.ep).tolist()


def node_split_problem(groups: list[list[int]], topology: Topology) -> Optional[str]:
    """Why the ep groups cannot be split node by node (None: each spans whole blocks of equal size on its nodes)."""
    split = split_by_node(groups, topology)
    if split is None:
        return f"an ep group {groups[0]} holds unequal numbers of ranks on the nodes it spans"
    per_node = len(split[0][0])
    for group in groups:
        nodes = [topology.node_of(rank) for rank in group]
        if any(nodes[i] != nodes[i - i % per_node] for i in range(len(group))):
            return f"the ep group {group} does not hold its ranks node by node"
    return None


def ep_dispatch_problem(layout: MeshLayout, fold: bool, topology: Optional[Topology]) -> Optional[str]:
    """Why ep_dispatch="by_node" cannot run on this layout and topology (None: it can)."""
    if layout.ep == 1 or topology is None or topology.devices_per_node is None:
        return None
    problem = node_split_problem(expert_parallel_groups(layout, fold), topology)
    if problem is None:
        return None
    return (
        f"ep_dispatch='by_node' with ep={layout.ep} on {topology.nodes} nodes x {topology.devices_per_node} devices:"
        f" {problem}; choose ep so that each node holds the same consecutive share of every ep group (ep a multiple"
        f" or a divisor of the ranks per node along dp_shard x cp), or ep_dispatch='all_to_all'"
    )


def node_groups(
    root: DeviceMesh, layout: MeshLayout, fold: bool, topology: Topology, ep_group: Any
) -> Optional[tuple[Any, Any]]:
    """(this rank's inter-node group, its intra-node group) of its ep group `ep_group`, or None where the ep group sits
    on one node. Call on every rank in the same order: it creates process groups (through the mesh's pool)."""
    groups = expert_parallel_groups(layout, fold)
    mine = dist.get_process_group_ranks(ep_group)
    if mine not in groups:  # the arithmetic (usable before any process starts) must be the mesh's own
        raise RuntimeError(f"ep group {mine} of the mesh is not among those by_node splits: {groups}")
    split = split_by_node(groups, topology)
    assert split is not None  # the launch rule "ep_dispatch_by_node_fits_topology"
    intra, inter = split
    if len(inter[0]) == 1:
        return None
    pool = group_pool(root)
    return pool.group_of_rank(inter), pool.group_of_rank(intra)


def pair_split_sizes(on_host: torch.Tensor) -> tuple[list[int], list[int], list[int], list[int]]:
    """The tokens and assignments this rank sends to / receives from each node, as host integers, from
    exchange_counts' host copy (2, nodes, 2)."""
    send, recv = on_host.tolist()
    return [s[0] for s in send], [s[1] for s in send], [r[0] for r in recv], [r[1] for r in recv]


class ByNodeDispatch:
    """An ep group's dispatch in two stages (module doc): `inter_group` holds this rank's counterparts on the other
    nodes, `within_node` is the all-to-all dispatch over this node's ranks of the group, which owns the routing
    statistics (the load over every rank that routes), the experts' tensor parallel and their gradient scale (of the
    whole ep group: the experts see every node's tokens)."""

    def __init__(self, inter_group: Any, within_node: Any) -> None:
        self.inter_group = inter_group
        self.nodes = dist.get_world_size(inter_group)
        self.within_node = within_node
        self.n_experts = within_node.n_experts * self.nodes  # within_node routes among its node's experts

    reduces_load_later = True  # as AllToAllDispatch: the model sums the load once per step

    def mean_probs(self, probs: torch.Tensor) -> torch.Tensor:
        return self.within_node.mean_probs(probs)

    def global_load(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.within_node.global_load(tokens_per_expert)

    # eager under compile_blocks: traced, its data-sized ops broke selective AC's matching of the recompute's ops to the
    # forward's (torch 2.13, aot_eager; tests/integration/test_topology.py runs it compiled under selective AC)
    @torch.compiler.disable
    def combine(
        self,
        experts: nn.Module,
        tokens: torch.Tensor,
        token_index: torch.Tensor,
        weights: torch.Tensor,
        tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        """Each token's weighted sum of its experts' outputs (N, dim), as AllToAllDispatch.combine."""
        nodes, n_tokens, device = self.nodes, tokens.shape[0], tokens.device
        per_node = self.n_experts // nodes  # experts on one node
        if n_tokens >= _EXACT_IN_FLOAT32 or per_node >= _EXACT_IN_FLOAT32:
            raise ValueError(
                f"ep_dispatch='by_node' routes at most 2**24 tokens per rank and micro-batch (its table carries their"
                f" rows in float32), got {n_tokens}; use a smaller micro-batch, or ep_dispatch='all_to_all'"
            )
        # assignments come grouped by expert, experts node by node: so they are grouped by node as well
        expert = torch.arange(self.n_experts, device=device).repeat_interleave(
            tokens_per_expert, output_size=token_index.shape[0]
        )
        node = expert // per_node
        # 1. one row per (node, token) pair that has an assignment there; each pair's row in its node's block
        present = torch.zeros(nodes, n_tokens, dtype=torch.bool, device=device)
        present[node, token_index] = True
        row_in_block = present.cumsum(1) - 1
        send_counts = torch.stack([present.sum(1), tokens_per_expert.view(nodes, per_node).sum(1)], dim=1)
        recv_counts, on_host = exchange_counts(send_counts, self.inter_group.group_name)  # kept by selective AC
        send_pairs, send_assigned, recv_pairs, recv_assigned = pair_split_sizes(on_host)
        pair_token = torch.nonzero_static(present, size=sum(send_pairs))[:, 1]  # node by node, tokens in order
        received = all_to_all_single_autograd(tokens[pair_token], recv_pairs, send_pairs, group=self.inter_group)
        table = torch.cat(
            [torch.stack([row_in_block[node, token_index], expert % per_node], 1).float(), weights[:, None].float()], 1
        )
        received_table = all_to_all_single_autograd(table, recv_assigned, send_assigned, group=self.inter_group)
        # 2. inside the node: each received assignment's token row (its source node's block first), by expert
        source = torch.arange(nodes, device=device).repeat_interleave(recv_counts[:, 1], output_size=sum(recv_assigned))
        block_start = recv_counts[:, 0].cumsum(0) - recv_counts[:, 0]
        row = received_table[:, 0].detach().long() + block_start[source]
        node_expert = received_table[:, 1].detach().long()
        by_expert = torch.argsort(node_expert, stable=True)
        # counted by index_add, not bincount: bincount reads the largest value on the host
        per_expert = torch.zeros(per_node, dtype=torch.long, device=device).index_add_(
            0, node_expert, torch.ones_like(node_expert)
        )
        weight = received_table[:, 2][by_expert]
        per_pair = self.within_node.combine(experts, received, row[by_expert], weight, per_expert)
        # 3. each pair's partial sum home, summed per token
        group_name = self.inter_group.group_name
        return combine_expert_outputs(per_pair, pair_token, n_tokens, send_pairs, recv_pairs, group_name)
