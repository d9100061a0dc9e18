"""The planner's MoE time terms (lit_mesh/planner/cost.py): grouped GEMMs slow down as each expert gets fewer rows,
the all-to-alls grow with the experts a token visits, the router costs memory traffic, and the published MoE runs
are in calibration.yaml (tests/unit/test_planner.py's calibration test evaluates every row)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.calibration import check, fit_routing_cv, planned_step, routing_cv, runs
from lit_mesh.planner.cost import (
    Features,
    StepTime,
    calibrated_kernels,
    ep_nodes_spanned,
    step_time,
    tokens_per_expert,
)
from lit_mesh.planner.hardware import GB, GIB, Hardware
from lit_mesh.planner.memory import Workload, block_activation_elements_per_token, rank_memory
from lit_mesh.planner.search import expert_variants
from lit_mesh.planner.shapes import expected_maximum_of_normals, gpt_shapes
from zoo.moe import MoEConfig

HW = Hardware(nodes=8, devices_per_node=8, memory_bytes=80 * GB)
WORK = Workload(global_batch=64, seq_len=4096, micro_batch=1)
LAYOUT = MeshLayout(dp_shard=64, ep=8)
LIT_MESH = Features()  # how lit_mesh runs: no all-to-all overlap, ep at stride tp, the pp routing pass


def _time(config: MoEConfig, layout: MeshLayout = LAYOUT, features: Features = LIT_MESH) -> StepTime:
    return step_time(gpt_shapes(config), layout, WORK, "bf16-mixed", "none", HW, features)


def _mixtral(**overrides: object) -> MoEConfig:
    return MoEConfig.from_preset("mixtral-8x7b", n_layers=2, **overrides)


def test_fewer_tokens_per_expert_run_the_grouped_gemm_further_from_peak() -> None:
    kern = calibrated_kernels()
    rows = [tokens_per_expert(4096, top_k=8, ep=1, n_experts=e) for e in (8, 64, 256, 1024)]
    assert rows == sorted(rows, reverse=True)
    efficiencies = [kern.grouped_gemm_efficiency(m, 2048, 7168) for m in rows]
    assert efficiencies == sorted(efficiencies, reverse=True) and efficiencies[-1] < 0.9 * efficiencies[0]
    # the same active expert FLOPs per token split over 8x more, 8x narrower experts: each gets 8x fewer rows
    coarse = _mixtral(n_experts=8, top_k=2, expert_hidden=14336)
    fine = _mixtral(n_experts=64, top_k=16, expert_hidden=1792)
    assert coarse.flops_per_token(4096) == fine.flops_per_token(4096) + 2 * 4096 * (8 - 64) * 6
    assert _time(fine).compute_parts["gemm"] > _time(coarse).compute_parts["gemm"]


def test_more_experts_per_token_send_more_all_to_all() -> None:
    times = [_time(_mixtral(top_k=k)) for k in (1, 2, 4)]
    exposed = [t.exposed["ep"] for t in times]
    assert exposed[0] < exposed[1] < exposed[2]
    # bytes grow with the routed copies, top_k per token; the ring steps' latency does not
    assert exposed[2] - exposed[1] == pytest.approx(2 * (exposed[1] - exposed[0]))
    assert [t.overlapped["ep"] for t in times] == exposed  # lit_mesh hides none of them


def test_overlapped_all_to_all_exposes_only_what_exceeds_the_compute() -> None:
    config = _mixtral(n_experts=64, top_k=8, expert_hidden=1024)  # fine-grained: more bytes per FLOP
    across_nodes = MeshLayout(dp_shard=32, tp=2, ep=8)  # lit_mesh's ep ranks at stride tp: 16 ranks, 2 nodes
    plain = _time(config, across_nodes)
    overlapped = _time(config, across_nodes, Features(ep_overlap=True))
    assert overlapped.overlapped["ep"] == plain.overlapped["ep"]
    assert 0 < overlapped.exposed["ep"] < plain.exposed["ep"]
    # the same ep group folded onto one node (NVLink) instead of across the two
    assert _time(config, across_nodes, Features(ep_stride=1)).exposed["ep"] < plain.exposed["ep"]
    # on one node they are shorter than the block's compute: fully hidden
    assert _time(config, LAYOUT, Features(ep_overlap=True)).exposed["ep"] == 0 < _time(config).exposed["ep"]


def test_router_cost_grows_with_experts_and_routed_copies() -> None:
    base = _time(_mixtral()).compute_parts["router"]
    assert _time(_mixtral(n_experts=64)).compute_parts["router"] > base
    assert _time(_mixtral(top_k=4)).compute_parts["router"] > base
    assert base > 0


def test_routing_pass_only_where_lit_mesh_runs_it() -> None:
    layout = MeshLayout(pp=2, dp_shard=32, ep=8)
    with_pass = _time(_mixtral(), layout, Features())
    without = _time(_mixtral(), layout, Features(routing_pass=False))
    assert with_pass.compute_parts["routing_pass"] > 0 and "routing_pass" not in without.compute_parts
    assert without.exposed["ep"] == pytest.approx(with_pass.exposed["ep"] * 4 / 6)  # 2 of 6 passes are its


def test_published_moe_runs_are_calibration_and_held_out_rows() -> None:
    moe = [r for r in runs() if r.get("model") == "moe"]
    assert {r["role"] for r in moe} == {"calibration", "held-out"}
    assert {r["preset"] for r in moe} >= {"mixtral-8x22b", "deepseek-v3", "qwen3-235b-a22b"}
    for r in moe:
        assert r["source"] and MoEConfig.from_preset(r["preset"]).n_experts > 1
        assert MeshLayout(**r["layout"]).ep > 1


def test_deepseek_v3_preset_has_the_published_shapes() -> None:
    c = MoEConfig.from_preset("deepseek-v3")
    assert (c.n_layers, c.dim, c.n_experts, c.n_shared_experts, c.top_k, c.expert_hidden) == (
        61,
        7168,
        256,
        1,
        8,
        2048,
    )
    assert dataclasses.replace(c, n_layers=1).score_func == "sigmoid"
    assert (c.n_groups, c.topk_groups) == (8, 4)  # config.json's n_group / topk_group: at most 4 nodes per token


def test_qwen3_235b_preset_has_the_published_shapes() -> None:
    """Qwen3-235B-A22B: heads of 128 on dim 4096 (64 of them: wq is 8192 x 4096), 235B parameters (its QK-norm's
    2 x 128 per layer left out)."""
    c = MoEConfig.from_preset("qwen3-235b-a22b")
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.attention_head_dim) == (94, 4096, 64, 4, 128)
    assert (c.n_experts, c.top_k, c.expert_hidden, c.n_shared_experts) == (128, 8, 1536, 0)
    # transformers' Qwen3MoeForCausalLM of the published config.json has 235,093,634,560 (QK-norm included)
    assert gpt_shapes(c).numel() + 94 * 2 * 128 == 235_093_634_560


def test_planned_row_takes_the_fastest_fitting_option_or_names_the_layout() -> None:
    shapes, layout = gpt_shapes(_mixtral()), MeshLayout(pp=2, dp_shard=32, ep=8)
    work = Workload(global_batch=128, seq_len=4096, micro_batch=1)
    best = planned_step(shapes, layout, work, HW, LIT_MESH)
    published = step_time(shapes, layout, work, "bf16-mixed", "full", HW, LIT_MESH)
    assert best.total <= published.total
    with pytest.raises(ValueError, match="no AC, micro-batch or schedule fits"):
        planned_step(shapes, layout, work, dataclasses.replace(HW, memory_bytes=4.1 * GIB), LIT_MESH)


def test_nodes_a_token_visits_match_uniform_routing() -> None:
    """ep_dispatch="by_node" sends a token once per node its top_k experts sit on: the planner's expectation under
    uniform routing against sampled routings (128 experts, top 8, on 4 and 8 nodes; Qwen3's and a finer split)."""
    generator = torch.Generator().manual_seed(0)
    for nodes in (4, 8):
        config = _mixtral(n_experts=128, top_k=8)
        picks = torch.rand(20_000, 128, generator=generator).argsort(dim=1)[:, :8] // (128 // nodes)
        visited = torch.zeros(20_000, nodes).scatter_(1, picks, 1).sum(1).mean().item()
        assert gpt_shapes(config).with_ep_nodes(nodes).nodes_per_token == pytest.approx(visited, rel=0.01)
    assert gpt_shapes(_mixtral()).nodes_per_token == 1.0  # the all-to-all dispatch: no per-node step
    # group-limited routing (DeepSeek-V3's: 256 experts in 8 groups, top 8 among the best 4): uniform over the
    # groups, then over their experts; ep over 8 nodes (a group each) and over 4 (two groups each)
    deepseek = MoEConfig.from_preset("deepseek-v3", n_layers=2)
    for nodes in (8, 4):
        groups = torch.rand(20_000, 8, generator=generator).argsort(dim=1)[:, :4]  # (tokens, 4 groups)
        among = torch.rand(20_000, 128, generator=generator).argsort(dim=1)[:, :8]  # 8 of their 4 x 32 experts
        expert = groups.gather(1, among // 32) * 32 + among % 32
        picks = expert // (256 // nodes)
        visited = torch.zeros(20_000, nodes).scatter_(1, picks, 1).sum(1).mean().item()
        limited = gpt_shapes(deepseek).with_ep_nodes(nodes).nodes_per_token
        assert limited == pytest.approx(visited, rel=0.01) and limited <= 4
    unlimited = gpt_shapes(dataclasses.replace(deepseek, n_groups=1, topk_groups=1)).with_ep_nodes(8).nodes_per_token
    assert unlimited > gpt_shapes(deepseek).with_ep_nodes(8).nodes_per_token + 1


def test_by_node_dispatch_sends_less_between_nodes_and_keeps_more_under_selective() -> None:
    """ep 32 over 4 nodes: once per node over InfiniBand (and the copies inside the node over NVLink) is faster than
    every routed copy over InfiniBand; the planner prices it where an ep group spans nodes; selective AC keeps the
    tokens received between nodes too."""
    config = _mixtral(n_experts=128, top_k=8, expert_hidden=1536)
    shapes, layout = gpt_shapes(config), MeshLayout(dp_shard=64, ep=32)
    by_node = shapes.with_ep_nodes(4)
    plain, two_stage = (step_time(s, layout, WORK, "bf16-mixed", "none", HW, LIT_MESH) for s in (shapes, by_node))
    assert two_stage.exposed["ep"] < plain.exposed["ep"] / 2
    assert ep_nodes_spanned(shapes, layout, HW) == 4 and ep_nodes_spanned(shapes, LAYOUT, HW) == 1
    assert expert_variants(shapes, layout, HW) == [by_node]
    assert expert_variants(shapes, LAYOUT, HW) == [shapes]  # ep 8 inside a node: nothing to save
    flat_kept, by_node_kept = (
        block_activation_elements_per_token(s, 1, "selective", 2, ep=32) for s in (shapes, by_node)
    )
    assert by_node_kept - flat_kept == pytest.approx(by_node.nodes_per_token * config.dim + 8 * 12 / 2)
    # without AC nothing of the first stage is saved (its gathers save indices only)
    flat_none, by_node_none = (block_activation_elements_per_token(s, 1, "none", 2, ep=32) for s in (shapes, by_node))
    assert by_node_none == flat_none


@pytest.mark.parametrize(
    ("preset", "saves"), [("mixtral-8x7b", True), ("qwen3-235b-a22b", True), ("deepseek-v3", True), ("tiny", False)]
)
def test_by_node_dispatch_is_never_much_slower_where_ep_spans_nodes(preset: str, saves: bool) -> None:
    """The planner prices only the by-node dispatch where an ep group spans nodes (search.expert_variants): across
    ep degrees, tp (experts split or whole), micro-batches and AC modes its all-to-all time stays within 3% of the
    all-to-all dispatch's (where a node holds one rank of the group and one of a token's experts, it saves nothing
    and sends its table too: the tiny preset's 8 experts over ep 4 and 8), and is below it where a node holds
    several."""
    hw = Hardware(nodes=128, devices_per_node=8, memory_bytes=80 * GB)
    config = MoEConfig.from_preset(preset, n_layers=2)
    ratios = []
    for tp, whole, ep, micro_batch in itertools.product((1, 2, 8), (False, True), (4, 8, 32, 64), (1, 4)):
        shapes = gpt_shapes(config).with_whole_experts() if whole else gpt_shapes(config)
        layout = MeshLayout(dp_shard=1024 // tp, tp=tp, ep=ep)
        nodes = ep_nodes_spanned(shapes, layout, hw)
        if (whole and tp == 1) or config.n_experts % ep or (not whole and (1024 // tp) % ep) or nodes == 1:
            continue
        work = Workload(1024 // tp * micro_batch, 4096, micro_batch)
        for ac in ("none", "selective", "full"):
            flat, by_node = (
                step_time(s, layout, work, "bf16-mixed", ac, hw, LIT_MESH).exposed["ep"]
                for s in (shapes, shapes.with_ep_nodes(nodes))
            )
            ratios.append(by_node / flat)
    assert ratios and max(ratios) < 1.03 and (min(ratios) < 0.9) == saves, (min(ratios), max(ratios))


def _sampled_imbalance(cv: float, sequences: int, experts: int, ep: int, generator: torch.Generator) -> float:
    """The busiest of ep ranks' load over the mean, each rank summing its experts' shares of the sequences, every
    (sequence, expert) share drawn from a gamma distribution with this coefficient of variation (mean of 2,000)."""
    shape = torch.full((2_000, ep, experts, sequences), 1 / cv**2)
    loads = torch._standard_gamma(shape, generator=generator).sum(dim=(2, 3))
    return (loads.max(1).values / loads.mean(1)).mean().item()


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_dropless_imbalance_follows_sampled_expert_loads(cv: float) -> None:
    """ModelShapes.routing_imbalance against sampled loads: the busiest ep rank over the mean, as the sequences an
    ep group routes per micro-batch and the experts per rank change (4 layouts); a normal sum's maximum, it stays
    within 5% of gamma-distributed shares for cv <= 2 (heavier tails sit further out: 8% at Qwen3's 4.41)."""
    generator = torch.Generator().manual_seed(0)
    assert expected_maximum_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-4)
    shapes = gpt_shapes(MoEConfig.from_preset("qwen3-235b-a22b", n_layers=2)).with_routing_cv(cv)
    whole = shapes.with_whole_experts()
    # (shapes, ep, tp, cp, micro-batch) -> sequences per ep group, experts per rank
    cases = [
        (whole, 8, 4, 1, 1, 2, 16),
        (whole, 8, 2, 1, 1, 4, 16),
        (shapes, 8, 2, 1, 4, 32, 16),
        (whole, 32, 2, 1, 1, 16, 4),
    ]
    for s, ep, tp, cp, micro, sequences, experts in cases:
        sampled = _sampled_imbalance(cv, sequences, experts, ep, generator)
        assert s.routing_imbalance(ep, tp, cp, micro) == pytest.approx(sampled, rel=0.05), (ep, tp, micro, cv)


def test_dropless_imbalance_slows_the_experts_and_all_to_alls_not_memory() -> None:
    """An uneven router's dropless run waits for the busiest ep rank: its experts' GEMMs and all-to-alls grow, the
    rest of the step and the memory (which rank is busiest changes with the layer and micro-batch) do not; with one
    ep rank (every expert on it), with cv 0, or with larger micro-batches, less or nothing."""
    shapes = gpt_shapes(_mixtral(n_experts=64, top_k=8))
    uneven = shapes.with_routing_cv(2.0)
    imbalance = uneven.routing_imbalance(LAYOUT.ep, 1, 1, WORK.micro_batch)
    assert imbalance > 1.3 and shapes.routing_imbalance(LAYOUT.ep, 1, 1, 1) == 1.0
    assert uneven.routing_imbalance(1, 1, 1, 1) == 1.0
    assert 1 < uneven.routing_imbalance(LAYOUT.ep, 1, 1, 8) < imbalance
    even, slow = (step_time(s, LAYOUT, WORK, "bf16-mixed", "none", HW, LIT_MESH) for s in (shapes, uneven))
    assert slow.exposed["ep"] == pytest.approx(even.exposed["ep"] * imbalance)
    assert slow.compute_parts["gemm"] > even.compute_parts["gemm"]
    assert {k: v for k, v in slow.compute_parts.items() if k != "gemm"} == {
        k: v for k, v in even.compute_parts.items() if k != "gemm"
    }
    assert rank_memory(uneven, LAYOUT, WORK, "bf16-mixed", "none") == rank_memory(
        shapes, LAYOUT, WORK, "bf16-mixed", "none"
    )
    single = MeshLayout(dp_shard=64)
    assert step_time(uneven, single, WORK, "bf16-mixed", "none", HW).total == pytest.approx(
        step_time(shapes, single, WORK, "bf16-mixed", "none", HW).total
    )


def test_routing_cv_is_the_fit_of_its_published_pair_and_dropless_rows_use_it() -> None:
    """calibration.yaml's routing_cv of each router is what fit_routing_cv finds on its published pair (forced
    balance against dropless: Qwen3's long-context runs, Mixtral's two figures), not chosen on the held-out rows;
    every dropless row's preset has one."""
    for preset in ("qwen3-235b-a22b", "mixtral-8x22b"):
        assert routing_cv(preset) == pytest.approx(fit_routing_cv(preset), abs=0.02)
    assert routing_cv("qwen3-235b-a22b") > 10 * routing_cv("mixtral-8x22b") > 0  # 128 fine experts against 8
    dropless = [r for r in runs() if r.get("routing") == "dropless"]
    assert len(dropless) >= 4 and all(routing_cv(r["preset"]) > 0 for r in dropless)
    with pytest.raises(ValueError, match="'deepseek-v3': calibration.yaml's `routing` has no routing_cv"):
        routing_cv("deepseek-v3")
    with pytest.raises(ValueError, match="routing 'dropples': choose 'balanced' or 'dropless'"):
        check({**dropless[0], "routing": "dropples"})
