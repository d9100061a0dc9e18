"""Two simulated SLURM nodes on localhost: the topology MeshStrategy reads, TP and node-local groups, and the
hierarchical all-reduce against the flat one (raw tensors, DDP and HSDP gradients through FSDP2, layered
compression). Run by tests/integration/test_topology.py: one process per SLURM task, SLURM_* set as srun would.

Usage: python tests/workers/topology_units.py OUT_DIR CHECK[,CHECK...]   (rank r writes OUT_DIR/rank{r}.json, see
tests/workers/checks.py; each check is its own pytest id)
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from torch import nn

from lit_mesh import CompressionOptions, MeshStrategy, Topology
from lit_mesh.comm import hierarchical
from lit_mesh.comm.codecs import CodecSettings, make_codec
from lit_mesh.comm.compression import CompressionRun
from lit_mesh.comm.powersgd import segments_of_shapes
from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.parallel.data import apply_data_parallel, attach_compression, data_parallel_mesh
from tests.workers import exit_skipping_teardown
from tests.workers.checks import Checks, arguments, assert_close_reduced

NODES, PER_NODE = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
RANK, WORLD = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
TOPOLOGY = Topology(nodes=NODES, devices_per_node=PER_NODE)
check = Checks()


def ranks_of(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def every_rank(length: int, integer: bool, step: int = 0) -> list[torch.Tensor]:
    """Every rank's input (each rank draws all: the expected values need them)."""
    out = []
    for r in range(WORLD):
        gen = torch.Generator().manual_seed(1000 * step + r)
        out.append(
            torch.randint(-8, 9, (length,), generator=gen).float() if integer else torch.randn(length, generator=gen)
        )
    return out


@check
def strategy_reads_slurm() -> None:
    """Before any process group: the Trainer picks SLURMEnvironment and MeshStrategy the topology from it."""
    trainer = Trainer(accelerator="cpu", devices=PER_NODE, num_nodes=NODES, strategy=MeshStrategy(tp=2), logger=False)
    env = trainer.strategy.cluster_environment
    assert isinstance(env, SLURMEnvironment), type(env)
    assert trainer.strategy.topology == TOPOLOGY, trainer.strategy.topology
    assert (env.global_rank(), env.node_rank(), env.local_rank()) == (RANK, RANK // PER_NODE, RANK % PER_NODE)
    assert env.world_size() == WORLD


@check
def tp_groups_inside_a_node() -> None:
    layout = MeshLayout(dp_replicate=2, dp_shard=WORLD // 4, tp=2)
    views = build_device_mesh(layout, "cpu")
    tp = ranks_of(views.root.get_group("tp"))
    assert len({TOPOLOGY.node_of(r) for r in tp}) == 1, tp
    assert "rank    1 -> node 0, local rank 1: pp=0, dp_replicate=0" in TOPOLOGY.placement(layout)


def node_local_groups(layout: MeshLayout, view: str, g: int, n: int) -> hierarchical.Hierarchy:
    views = build_device_mesh(layout, "cpu")
    group = views[view].get_group()
    h = hierarchical.build_hierarchy(views.root, views.axes_of(view), group, TOPOLOGY, "hierarchical", "dp_replicate")
    assert h is not None and (h.per_node, h.nodes) == (g, n), (h, g, n)
    members = ranks_of(group)
    intra, inter = ranks_of(h.intra), ranks_of(h.inter)
    assert intra == [r for r in members if TOPOLOGY.node_of(r) == TOPOLOGY.node_of(RANK)], (intra, members)
    assert len({TOPOLOGY.node_of(r) for r in inter}) == n and RANK in inter and set(inter) <= set(members), inter
    # "flat" makes no groups; "auto" leaves a 4-byte metric to NCCL on H100 links (its tree has the hierarchy's
    # latency in one collective, not three), and goes hierarchical for 1 MB where slow links inside the node bound
    # NCCL's ring
    assert hierarchical.build_hierarchy(views.root, views.axes_of(view), group, TOPOLOGY, "flat", "x") is None
    auto = hierarchical.Hierarchy(group, h.intra, h.inter, n, g, "auto", TOPOLOGY, "x")
    assert not auto.use_hierarchical(4)
    slow_intra = Topology(NODES, PER_NODE, intra_node_bandwidth=1e6, inter_node_bandwidth=50e9)
    assert hierarchical.Hierarchy(group, h.intra, h.inter, n, g, "auto", slow_intra, "x").use_hierarchical(2**20)
    return h


@functools.cache
def ddp_hierarchy() -> hierarchical.Hierarchy:
    """The DDP group's hierarchy, made once and shared by the checks that use it (one launch runs them all)."""
    return node_local_groups(MeshLayout(dp_replicate=WORLD), "dp_replicate", PER_NODE, NODES)


@check
def node_local_groups_ddp() -> None:
    ddp_hierarchy()


@check
def node_local_groups_hsdp() -> None:
    """Two replicas per node (4 tasks per node): node-local groups; one replica per node: nothing to gain, no groups."""
    if PER_NODE >= 4:
        node_local_groups(MeshLayout(dp_replicate=WORLD // 2, dp_shard=2), "dp_replicate", PER_NODE // 2, NODES)
    else:
        hsdp_stays_flat()


@check
def node_local_groups_metrics() -> None:
    node_local_groups(MeshLayout(dp_shard=WORLD), "dp_cp", PER_NODE, NODES)


def hsdp_stays_flat() -> None:
    views = build_device_mesh(MeshLayout(dp_replicate=NODES, dp_shard=PER_NODE), "cpu")
    group = views.root.get_group("dp_replicate")
    assert hierarchical.build_hierarchy(views.root, ("dp_replicate",), group, TOPOLOGY, "hierarchical", "x") is None


@check
def raw_all_reduce() -> None:
    h = ddp_hierarchy()
    members = ranks_of(h.group)
    for integer in (True, False):
        xs = every_rank(1001, integer)  # not a multiple of g: the padding must drop out
        for average in (False, True):
            flat = xs[RANK].clone()
            dist.all_reduce(flat, group=h.group)
            flat = flat / len(members) if average else flat
            out = hierarchical.all_reduce(xs[RANK].clone(), h, average=average)
            if integer:
                assert torch.equal(out, flat), (out - flat).abs().max()
            else:
                assert_close_reduced(out, flat, len(members))  # the same sums, hierarchical order
            # and what every member expects, computed from all inputs
            total = torch.stack([xs[r] for r in members]).sum(0)
            assert_close_reduced(out, total / len(members) if average else total, len(members))


@check
def layered_compression() -> None:
    """fp16, 1-bit and PowerSGD on the inter-node step of the DDP group's hierarchical all-reduce."""
    h = ddp_hierarchy()
    g, n = h.per_node, h.nodes
    members = ranks_of(h.group)
    xs = every_rank(g * n * 64 * 2, integer=True)
    flat = xs[RANK].clone()
    dist.all_reduce(flat, group=h.group)
    flat /= len(members)
    # fp16 on small integers is exact: layered compression must give the flat mean exactly
    run = CompressionRun(CompressionOptions(mode="fp16"))
    out = hierarchical.all_reduce(xs[RANK].clone(), h, average=True, site=run.site("site"))
    assert torch.equal(out, flat), (out - flat).abs().max()
    bytes_ = run.meter.current
    assert set(bytes_) == {"dp_replicate:intra", "dp_replicate:inter"}, dict(bytes_)
    assert bytes_["dp_replicate:intra"]["sent"] == bytes_["dp_replicate:intra"]["uncompressed"] > 0  # exact in the node
    assert bytes_["dp_replicate:inter"]["sent"] * 2 == bytes_["dp_replicate:inter"]["uncompressed"]  # fp16 between
    # a codec per level (intra_mode): fp16 inside the node too, still exact on small integers, half the bytes there
    run = CompressionRun(CompressionOptions(mode="fp16", intra_mode="fp16"))
    out = hierarchical.all_reduce(xs[RANK].clone(), h, average=True, site=run.site("site"))
    assert torch.equal(out, flat), (out - flat).abs().max()
    bytes_ = run.meter.current
    assert bytes_["dp_replicate:intra"]["sent"] * 2 == bytes_["dp_replicate:intra"]["uncompressed"] > 0, dict(bytes_)
    assert bytes_["dp_replicate:inter"]["sent"] * 2 == bytes_["dp_replicate:inter"]["uncompressed"] > 0, dict(bytes_)
    # int8 inside, 1-bit between: bytes against each codec's formula, per level
    run = CompressionRun(
        CompressionOptions(mode="onebit", intra_mode="int8", quant_block=32, onebit_block=32, onebit_rms_refresh=0)
    )
    piece = xs[RANK].numel() // g  # each rank's share of the node's sum
    hierarchical.all_reduce(
        every_rank(g * n * 64 * 2, integer=False)[RANK].clone(), h, average=True, site=run.site("site")
    )
    bytes_ = run.meter.current
    int8, onebit = run.codec("int8"), run.codec("onebit")
    assert bytes_["dp_replicate:intra"]["sent"] == 2 * (g - 1) * int8.payload_bytes(piece), dict(
        bytes_
    )  # scatter + gather
    assert bytes_["dp_replicate:inter"]["sent"] == 2 * (n - 1) * onebit.payload_bytes(piece // n), dict(bytes_)
    assert bytes_["dp_replicate:intra"]["uncompressed"] == 2 * (g - 1) / g * 4 * xs[RANK].numel()
    assert run.sites["site:intra"].residual is not None, "error feedback inside the node too"
    # 1-bit between nodes: the node sums of this rank's piece, through the 1-bit all-reduce (scatter and gather halves)
    run = CompressionRun(CompressionOptions(mode="onebit", onebit_block=32, onebit_rms_refresh=0))
    site = run.site("site")
    xs = every_rank(g * n * 64 * 2, integer=False)
    out = hierarchical.all_reduce(xs[RANK].clone(), h, average=True, site=site)
    codec = make_codec("onebit", CodecSettings(onebit_block=32))
    roundtrip = lambda t: codec.decode(codec.encode(t), t.numel(), t.dtype)  # noqa: E731
    inter = ranks_of(h.inter)
    nodes = [[r for r in members if TOPOLOGY.node_of(r) == TOPOLOGY.node_of(i)] for i in inter]
    pieces = [torch.stack([xs[r] for r in node]).sum(0).view(g, -1) for node in nodes]  # node sums, by chunk
    expected = []
    for j in range(g):  # chunk j is reduced between nodes by the j-th rank of every node
        sent = [torch.cat([roundtrip(c) for c in piece[j].view(n, -1)]) for piece in pieces]
        means = (torch.stack(sent).sum(0) / n).view(n, -1)
        expected.append(torch.cat([roundtrip(m) for m in means]) / g)
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-6)
    assert site.residual is not None and site.residual.numel() == out.numel() // g  # error feedback on the piece only
    # PowerSGD needs whole matrices: exact node sum, then the whole matrix compressed between nodes
    xs = every_rank(32 * 16, integer=False)
    segments = segments_of_shapes([torch.Size([32, 16])])
    run = CompressionRun(CompressionOptions(mode="powersgd", powersgd_rank=2))
    out = hierarchical.all_reduce(xs[RANK].clone(), h, average=True, site=run.site("site"), segments=segments)
    node_sum = torch.stack([xs[r] for r in members if TOPOLOGY.node_of(r) == TOPOLOGY.node_of(RANK)]).sum(0)
    reference = CompressionRun(CompressionOptions(mode="powersgd", powersgd_rank=2))
    reference.site("site").all_reduce(node_sum, h.inter, average=True, dim="ref", segments=segments)
    torch.testing.assert_close(out, node_sum / g, rtol=1e-5, atol=1e-6)
    mean = torch.stack([xs[r] for r in members]).mean(0)
    assert (out - mean).norm() > 1e-3 * mean.norm(), "rank 2 of a random 32 x 16 matrix must lose something"


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.relu(self.blocks[0](x)))


def fsdp_gradients(
    layout: MeshLayout, h: hierarchical.Hierarchy | None, compression: str | None, integer: bool = True
) -> dict[str, torch.Tensor]:
    """Gradients of one step, the full tensors. integer: integer weights and inputs, so every sum is exact;
    else random floats (sums differ by rounding with the order of reduction)."""
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape).float() if integer else torch.randn(p.shape))
    views = build_device_mesh(layout, "cpu")
    run = CompressionRun(CompressionOptions(mode=compression)) if compression else None
    mesh = data_parallel_mesh(views, layout, replicate_in_hook=h is not None or run is not None)
    apply_data_parallel([model], list(model.blocks), mesh, layout, "32-true")
    if run is not None:
        attach_compression(model, run, views, layout)
    if h is not None:
        hierarchical.attach_hierarchical_all_reduce(model, h, run)
    if run is not None:
        run.begin_step(0)
    gen = torch.Generator().manual_seed(RANK)
    x = torch.randint(-2, 3, (4, 16), generator=gen).float() if integer else torch.randn(4, 16, generator=gen)
    model(x).sum().backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


@check
def ddp_and_hsdp_gradients() -> None:
    # HSDP: dp_shard 2 inside a node; with 2 devices per node that leaves one replica per node, where the
    # hierarchy is trivial (built anyway here, to check the hook's plumbing: 1-D shard mesh, divide factors)
    for layout in (MeshLayout(dp_replicate=WORLD), MeshLayout(dp_replicate=WORLD // 2, dp_shard=2)):
        views = build_device_mesh(layout, "cpu")
        h = hierarchical.build_hierarchy(
            views.root,
            ("dp_replicate",),
            views.root.get_group("dp_replicate"),
            TOPOLOGY,
            "hierarchical",
            "dp_replicate",
            skip_trivial=False,
        )
        assert h is not None and h.nodes == NODES, layout
        flat = fsdp_gradients(layout, None, None)  # FSDP2's own all-reduce on the 2-D mesh
        for compression in (None, "fp16"):
            got = fsdp_gradients(layout, h, compression)
            for name, grad in flat.items():
                assert torch.equal(got[name], grad), (layout, compression, name, (got[name] - grad).abs().max())
        # random floats: equal within fp32 rounding; with layered fp16 within fp16 rounding of the inter-node step
        flat = fsdp_gradients(layout, None, None, integer=False)
        for compression, rtol in ((None, 1e-5), ("fp16", 2e-3)):
            got = fsdp_gradients(layout, h, compression, integer=False)
            for name, grad in flat.items():
                torch.testing.assert_close(
                    got[name],
                    grad,
                    rtol=rtol,
                    atol=rtol * grad.abs().max().item(),
                    msg=f"{layout} {compression} {name}",
                )
        assert not torch.equal(got["blocks.0.weight"], flat["blocks.0.weight"]), "fp16 between nodes must round"


def routed_tokens(n_tokens: int, n_experts: int, top_k: int, dim: int) -> tuple:
    """This rank's tokens and a random top-k routing as an MoE layer hands them to its dispatcher: assignments
    grouped by expert (token_index, weights, tokens_per_expert)."""
    gen = torch.Generator().manual_seed(7 + RANK)
    tokens = torch.randn(n_tokens, dim, generator=gen, requires_grad=True)
    chosen = torch.stack([torch.randperm(n_experts, generator=gen)[:top_k] for _ in range(n_tokens)])  # (N, k)
    weights = torch.rand(n_tokens, top_k, generator=gen, requires_grad=True)
    experts, order = chosen.flatten().sort(stable=True)
    token_index = torch.arange(n_tokens).repeat_interleave(top_k)[order]
    per_expert = torch.zeros(n_experts, dtype=torch.long).index_add_(0, experts, torch.ones_like(experts))
    return tokens, weights, order, token_index, per_expert, chosen


@check
def ep_by_node_dispatch() -> None:
    """ep over every rank of the nodes: ep_dispatch="by_node" gives the all-to-all dispatch's outputs and gradients
    (tokens, router weights, experts), and sends each token across nodes once per other node that holds one of its
    experts, not once per routed copy."""
    from unittest import mock

    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from lit_mesh.parallel import expert_by_node
    from lit_mesh.parallel.expert import AllToAllDispatch
    from zoo.moe import GroupedExperts

    layout = MeshLayout(dp_shard=WORLD, ep=WORLD)
    views = build_device_mesh(layout, "cpu")
    assert expert_by_node.ep_dispatch_problem(layout, False, TOPOLOGY) is None
    group = views.ep.get_group()
    inter, intra = expert_by_node.node_groups(views.root, layout, False, TOPOLOGY, group)
    node_ranks = list(range(RANK // PER_NODE * PER_NODE, (RANK // PER_NODE + 1) * PER_NODE))
    assert ranks_of(intra) == node_ranks and ranks_of(inter) == list(range(RANK % PER_NODE, WORLD, PER_NODE))
    local, top_k, dim = 2, 3, 8
    n_experts = local * WORLD
    full = GroupedExperts(n_experts, dim, 16)
    for i, w in enumerate(full.parameters()):
        nn.init.normal_(w, generator=torch.Generator().manual_seed(i), std=0.3)

    def run(by_node: bool) -> tuple:
        experts = GroupedExperts(local, dim, 16)
        with torch.no_grad():
            for mine, whole in zip(experts.parameters(), full.parameters()):
                mine.copy_(whole[RANK * local : (RANK + 1) * local])
        tokens, weights, order, token_index, per_expert, chosen = routed_tokens(24, n_experts, top_k, dim)
        flat = AllToAllDispatch(n_experts, group, group)
        dispatcher = flat
        if by_node:
            within = AllToAllDispatch(n_experts // NODES, group, intra, experts_seen_by=WORLD)
            dispatcher = expert_by_node.ByNodeDispatch(inter, within)
        sent_rows: list[list[int]] = []

        def recording(tensor, output_split_sizes, input_split_sizes, group):
            if group is inter and tensor.shape[1] == dim:  # the tokens between nodes (the table has 3 columns)
                sent_rows.append(list(input_split_sizes))
            return all_to_all_single_autograd(tensor, output_split_sizes, input_split_sizes, group)

        with mock.patch.object(expert_by_node, "all_to_all_single_autograd", recording):
            out = dispatcher.combine(experts, tokens, token_index, weights.flatten()[order], per_expert)
        out.mul(torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = [tokens.grad, weights.grad, *(p.grad for p in experts.parameters())]
        return out.detach(), grads, sent_rows, chosen

    flat_out, flat_grads, _, chosen = run(False)
    out, grads, sent_rows, _ = run(True)
    torch.testing.assert_close(out, flat_out, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, flat_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    node_of_expert = chosen // (local * PER_NODE)  # (tokens, k): the node of each routed copy
    here = RANK // PER_NODE
    pairs = [sorted(set(row.tolist())) for row in node_of_expert]
    other_node_pairs = sum(sum(1 for node in row if node != here) for row in pairs)
    other_node_copies = int((node_of_expert != here).sum())
    (splits,) = sent_rows  # one all-to-all of tokens between nodes in forward
    assert sum(splits) - splits[here] == other_node_pairs, (splits, other_node_pairs)
    assert other_node_pairs < other_node_copies, (other_node_pairs, other_node_copies)


if __name__ == "__main__":
    out_dir, selected = arguments()
    check.run([name for name in selected if name == "strategy_reads_slurm"])  # before any process group
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD)  # MASTER_ADDR/PORT set by the launcher
    check.run([name for name in selected if name != "strategy_reads_slurm"])
    check.write(out_dir, RANK)
    exit_skipping_teardown()
