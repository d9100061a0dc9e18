"""Expert-parallel parity through the `lit-mesh` CLI with configs/moe.yaml (dropless routing, aux loss and
aux-loss-free balancing on): ep2, ep4, fsdp4 x ep2, tp2 (expert tensor parallel), tp2 x ep2, hsdp 2x2 x ep2, cp2 x ep2,
pp2 x ep2 (pp2 alone: the variant below), whole experts under tp (expert_tp=1: tp2, tp2 x ep2, ep4 over dp_shard 2
x tp 2, pp2 x tp2, ep4 over cp 2 x tp 2) and group-limited routing on ep4 train the same model on the same global
batches as one device: relative 1e-4 per step over 10 steps, final full parameters within 1e-4, and the router and
expert gradients of the first step within 1e-5 of the single-device ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.integration.test_parity import COMMON, S, _assert_same_curve, losses
from tests.launch import REPO, cli_runs

CONFIG = str(REPO / "configs/moe.yaml")
GRADS = ["--trainer.callbacks+=tests.workers.moe_grads.SaveRoutingGradients"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "ep2": (2, [f"{S}ep=2"]),  # dp_shard 2, one expert pair per rank
    "ep4": (4, [f"{S}ep=4"]),  # dp_shard 4, one expert per rank
    "tp2": (2, [f"{S}tp=2"]),  # expert tensor parallel: each expert's hidden units split over tp, no ep
    "fsdp4_ep2": (4, [f"{S}dp=4", f"{S}ep=2"]),  # experts FSDP-sharded over the 2 ranks beside ep
    "tp2_ep2": (4, [f"{S}tp=2", f"{S}ep=2"]),  # dense parts TP/SP 2 x FSDP 2; experts split over ep and tp
    "hsdp2x2_ep2": (4, [f"{S}dp_replicate=2", f"{S}dp_shard=2", f"{S}ep=2"]),  # experts replicated over dp_replicate
    "cp2_ep2": (4, [f"{S}cp=2", f"{S}ep=2"]),  # sequences split over cp; ep borrows from dp_shard x cp
    # pipeline stages hold one MoE layer each: aux loss per stage and micro-batch, load of the whole step;
    # Megatron's MoE mapping scaled down: pp2 x ep2, tp1 (pp2 alone: the variant below)
    "pp2_ep2": (4, [f"{S}pp=2", f"{S}ep=2"]),
    # expert_tp=1 (MoE parallel folding): whole experts, each tp rank routes its own sequence shard
    "tp2_fold": (2, [f"{S}tp=2", f"{S}expert_tp=1"]),  # no data parallel: the experts FSDP-sharded over tp alone
    "tp2_ep2_fold": (4, [f"{S}tp=2", f"{S}ep=2", f"{S}expert_tp=1"]),  # ep = the tp pair, FSDP over dp_shard 2
    "tp2_ep4_fold": (4, [f"{S}tp=2", f"{S}ep=4", f"{S}expert_tp=1"]),  # ep over dp_shard 2 x tp 2: all 4 ranks
    "pp2_tp2_fold": (4, [f"{S}pp=2", f"{S}tp=2", f"{S}expert_tp=1"]),  # the load of every micro-batch and tp shard
    # cp x tp: each rank routes its cp chunk's tp shard; ep over cp x tp (all 4 ranks)
    "cp2_tp2_ep4_fold": (4, [f"{S}cp=2", f"{S}tp=2", f"{S}ep=4", f"{S}expert_tp=1"]),
}
PIPELINE_ONLY = {"pp2": (2, [f"{S}pp=2"])}
# shared experts, sigmoid scores, a dense block beside the MoE block (the TP plan of both kinds of blocks) and
# capacity-factor dropping (counted per sequence, so it drops the same assignments on every layout)
VARIANT = [
    "--model.init_args.config_overrides={n_layers: 3, moe_every: 2, n_shared_experts: 1, score_func: sigmoid,"
    " aux_loss_coef: 0.01, bias_update_rate: 0.001, capacity_factor: 1.0}"
]
# pp2 cuts it into a dense-only stage and a stage with the MoE block (a stage without MoE layers)
VARIANT_LAYOUTS = {"single": 1, "pp2": 2, "tp2_ep2": 4}
# whole experts under tp with shared experts, sigmoid scores and a dense block: dropless (capacity counts per
# sequence, which the tp ranks split: refused there)
FOLD_VARIANT = [VARIANT[0].replace(", capacity_factor: 1.0", "")]
FOLD_VARIANT_LAYOUTS = {"single": 1, "tp2_ep2_fold": 4}
# group-limited routing (DeepSeek-V3's node-limited routing): 8 experts in 4 groups, each token's top 2 among its
# best 2 groups; ep 4 holds one group per rank
GROUP_VARIANT = ["--model.init_args.config_overrides={n_experts: 8, n_groups: 4, topk_groups: 2}"]
GROUP_VARIANT_LAYOUTS = {"single": 1, "ep4": 4}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("moe_parity")
    found: dict[str, dict] = {}
    for nproc in (1, 2, 4):
        runs = [
            {"name": layout, "args": ["-c", CONFIG, f"--trainer.devices={n}", *COMMON, *GRADS, *extra]}
            for layout, (n, extra) in LAYOUTS.items()
            if n == nproc
        ]
        runs += [
            {
                "name": f"variant-{layout}",
                "args": [
                    "-c",
                    CONFIG,
                    f"--trainer.devices={n}",
                    *COMMON,
                    *{**LAYOUTS, **PIPELINE_ONLY}[layout][1],
                    *VARIANT,
                ],
            }
            for layout, n in VARIANT_LAYOUTS.items()
            if n == nproc
        ]
        runs += [
            {
                "name": f"fold-variant-{layout}",
                "args": ["-c", CONFIG, f"--trainer.devices={n}", *COMMON, *LAYOUTS[layout][1], *FOLD_VARIANT],
            }
            for layout, n in FOLD_VARIANT_LAYOUTS.items()
            if n == nproc
        ]
        runs += [
            {
                "name": f"group-variant-{layout}",
                "args": ["-c", CONFIG, f"--trainer.devices={n}", *COMMON, *LAYOUTS[layout][1], *GROUP_VARIANT],
            }
            for layout, n in GROUP_VARIANT_LAYOUTS.items()
            if n == nproc
        ]
        found.update(cli_runs(nproc, out, runs))
    found["_dir"] = {"path": str(out)}
    return found


def _load(results: dict, name: str, file: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(results["_dir"]["path"]) / name / file, weights_only=True)


# layout -> (ep, tp, ranks the expert weights are split over in all: ep x tp x the FSDP shards beside them)
EXPERT_SPLIT = {
    "single": (1, 1, 1),
    "ep2": (2, 1, 2),
    "ep4": (4, 1, 4),
    "fsdp4_ep2": (2, 1, 4),
    "tp2": (1, 2, 2),
    "tp2_ep2": (2, 2, 4),
    "hsdp2x2_ep2": (2, 1, 2),
    "cp2_ep2": (2, 1, 4),
    "pp2_ep2": (2, 1, 2),
    "tp2_fold": (1, 1, 2),  # whole experts: FSDP over the tp ranks
    "tp2_ep2_fold": (2, 1, 4),  # over ep, then FSDP over dp_shard x tp / ep = 2
    "tp2_ep4_fold": (4, 1, 4),  # one expert per rank, no FSDP shard left
    "pp2_tp2_fold": (1, 1, 2),
    "cp2_tp2_ep4_fold": (4, 1, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_is_really_applied(results: dict, layout: str) -> None:
    """Each MoE layer dispatches by all-to-all over ep ranks, and holds 1/(ep x tp x FSDP shards) of the experts:
    split by expert id over ep, by hidden unit over tp (w1/w3 (E, dim, hidden), w2 (E, hidden, dim))."""
    ep, tp, split = EXPERT_SPLIT[layout]
    token_tp = 2 if layout.endswith("_fold") else 1  # expert_tp=1: the tp ranks route their own tokens
    found = json.loads((Path(results["_dir"]["path"]) / layout / "expert_layout.json").read_text())
    assert len(found) == 2, found  # configs/moe.yaml: both layers MoE
    for name, layer in found.items():
        assert layer["dispatcher"] == ("LocalDispatch" if layout == "single" else "AllToAllDispatch"), (name, layer)
        assert (layer["ep"], layer["tp"], layer["token_tp"]) == (ep, tp, token_tp), (name, layer)
        for weight, hidden_dim in (("w1", 2), ("w3", 2), ("w2", 1)):
            full, local = layer[weight], layer[f"{weight}_local"]
            assert local[0] == full[0] // ep, (name, weight, layer)  # experts split by expert id over ep
            if tp > 1:  # hidden units over tp (FSDP then shards the other dim; with tp = 1 it may take this one)
                assert local[hidden_dim] == full[hidden_dim] // tp, (name, weight, layer)
            assert math.prod(local) * split == math.prod(full), (name, weight, layer)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_expert_parallel_matches_single_device(results: dict, layout: str) -> None:
    reference, candidate = results["single"], results[layout]
    assert candidate["world_size"] == LAYOUTS[layout][0]
    ref_losses = losses(reference)
    assert len(set(ref_losses)) == len(ref_losses), "the reference run must actually update the model"
    _assert_same_curve(ref_losses, losses(candidate), layout)
    for metric in ("train_aux_loss", "moe/imbalance", "moe/tokens_expert_0"):
        ref, got = reference["metrics"][metric], candidate["metrics"][metric]
        assert ref.keys() == got.keys()
        for step in ref:
            assert abs(ref[step] - got[step]) <= 1e-4 * abs(ref[step]), (metric, step, ref[step], got[step])

    ref_params, params = _load(results, "single", "params.pt"), _load(results, layout, "params.pt")
    assert ref_params.keys() == params.keys()
    for name, ref in ref_params.items():  # includes the balancing bias buffers
        diff = (params[name].float() - ref.float()).abs().max().item()
        assert diff <= 1e-4, f"{layout}: {name} differs by {diff}"

    ref_grads, grads = _load(results, "single", "grads.pt"), _load(results, layout, "grads.pt")
    assert (
        ref_grads.keys() == grads.keys()
        and any("experts.w1" in n for n in grads)
        and any("router.gate" in n for n in grads)
    )
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name
        diff = (grads[name] - ref).abs().max().item()
        assert diff <= 1e-5 * max(1.0, ref.abs().max().item()), f"{layout}: gradient of {name} differs by {diff}"


def test_balancing_is_logged_and_acts(results: dict) -> None:
    metrics = results["single"]["metrics"]
    per_expert = [metrics[f"moe/tokens_expert_{e}"] for e in range(4)]
    # 2 MoE layers x top-2 x 8 sequences x 64 tokens assignments per step, all counted
    assert all(sum(counts[step] for counts in per_expert) == 2 * 2 * 8 * 64 for step in per_expert[0])
    assert all(value >= 1.0 for value in metrics["moe/imbalance"].values())
    assert all(0 < value < 0.1 for value in metrics["train_aux_loss"].values())
    params = _load(results, "single", "params.pt")
    bias = params["model.layers.0.moe.router.expert_bias.bias"]
    # 10 updates of -0.001, 0 or +0.001 each: the bias moved, by whole multiples of the rate
    steps = bias / 0.001
    assert bias.abs().max() > 0 and steps.abs().max() <= 10 and torch.allclose(steps, steps.round(), atol=1e-3)


@pytest.mark.parametrize("layout", [name for name in VARIANT_LAYOUTS if name != "single"])
def test_dense_and_moe_blocks_and_capacity_dropping(results: dict, layout: str) -> None:
    reference, candidate = results["variant-single"], results[f"variant-{layout}"]
    _assert_same_curve(losses(reference), losses(candidate), f"variant {layout}")
    ref_dropped = reference["metrics"]["moe/dropped_fraction"]
    dropped = candidate["metrics"]["moe/dropped_fraction"]
    assert max(ref_dropped.values()) > 0, "capacity 1.0 must drop some assignments of the unbalanced router"
    assert all(abs(dropped[step] - ref_dropped[step]) <= 1e-6 for step in ref_dropped), (ref_dropped, dropped)
    ref_params, params = _load(results, "variant-single", "params.pt"), _load(results, f"variant-{layout}", "params.pt")
    assert any("feed_forward.w1" in n for n in params) and any("shared_experts" in n for n in params)
    assert ref_params.keys() == params.keys()
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 1e-4, name


def test_whole_experts_under_tp_with_shared_experts_and_a_dense_block(results: dict) -> None:
    """expert_tp=1 with the router and the shared experts run per tp rank's tokens (MoEPlan.token_wise): the
    single-device curve and parameters, the aux loss and the balancing bias included."""
    reference, candidate = results["fold-variant-single"], results["fold-variant-tp2_ep2_fold"]
    _assert_same_curve(losses(reference), losses(candidate), "fold variant tp2_ep2")
    for step, value in reference["metrics"]["train_aux_loss"].items():
        assert abs(candidate["metrics"]["train_aux_loss"][step] - value) <= 1e-4 * abs(value), step
    ref_params = _load(results, "fold-variant-single", "params.pt")
    params = _load(results, "fold-variant-tp2_ep2_fold", "params.pt")
    assert any("shared_experts" in n for n in params) and ref_params.keys() == params.keys()
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 1e-4, name


def test_group_limited_routing_on_expert_parallel(results: dict) -> None:
    """Group-limited routing (n_groups, topk_groups) under ep 4: the single-device curve, aux loss and parameters."""
    reference, candidate = results["group-variant-single"], results["group-variant-ep4"]
    assert "moe/tokens_expert_7" in reference["metrics"]  # the variant's 8 experts
    _assert_same_curve(losses(reference), losses(candidate), "group-limited ep4")
    ref_aux, aux = reference["metrics"]["train_aux_loss"], candidate["metrics"]["train_aux_loss"]
    assert all(abs(aux[step] - ref_aux[step]) <= 1e-4 * abs(ref_aux[step]) for step in ref_aux)
    ref_params, params = (
        _load(results, "group-variant-single", "params.pt"),
        _load(results, "group-variant-ep4", "params.pt"),
    )
    assert ref_params.keys() == params.keys()
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 1e-4, name
