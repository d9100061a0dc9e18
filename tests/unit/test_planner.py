"""lit-mesh plan: every proposed layout is one lit_mesh accepts and fits in memory; the parameter, gradient and
AdamW bytes it estimates equal the real sharding simulated on fake ranks; it answers for the Llama-3 presets
on 8 to 1024 GPUs in seconds, with reasons; the YAML it writes trains."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lit_mesh import MeshStrategy
from lit_mesh.mesh import MeshLayout
from lit_mesh.parallel.pipeline.split import balanced_split
from lit_mesh.parallel.tensor import PlanError
from lit_mesh.planner.command import main as plan_main
from lit_mesh.planner.config_yaml import fit_config, rehearsal_config
from lit_mesh.planner.hardware import GB, Hardware
from lit_mesh.planner.memory import Workload, state_bytes
from lit_mesh.planner.search import plan, why_invalid, why_wasteful
from lit_mesh.planner.shapes import gpt_shapes
from lit_mesh.planner.simulate import simulate_rank
from zoo.gpt import GPT, GPTConfig
from zoo.moe import MoEConfig

PRESETS = ("llama3-8b", "llama3-70b", "llama3-405b")
COMPONENTS = ("params", "grads", "optimizer")


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict, str]:
    status = plan_main([*argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out.strip().splitlines()[-1]), out


# (preset, layout, rank, precision): 64, 512 and 1024 ranks; HSDP, DDP, TP, PP (first and last stages), CP,
# uneven torch.chunk pieces (1000-way FSDP leaves the last ranks nothing of some tensors), bf16-true
SIMULATED = [
    ("llama3-8b", MeshLayout(dp_replicate=2, dp_shard=4, tp=8), 63, "bf16-mixed"),
    ("llama3-8b", MeshLayout(dp_replicate=8, tp=8), 9, "bf16-mixed"),  # DDP x TP: parameters whole over dp
    ("llama3-70b", MeshLayout(pp=4, dp_shard=16, tp=8), 511, "bf16-true"),
    ("llama3-405b", MeshLayout(pp=8, dp_replicate=2, dp_shard=8, tp=8), 0, "32-true"),
    ("llama3-8b", MeshLayout(dp_shard=512, cp=2), 1023, "bf16-mixed"),
    ("llama3-8b", MeshLayout(dp_shard=1000), 999, "bf16-mixed"),
    ("llama3.2-1b", MeshLayout(dp_shard=8, tp=8), 63, "bf16-mixed"),  # tied embeddings: one matrix, vocab-sharded
]


@pytest.mark.parametrize(
    ("preset", "layout", "rank", "precision"), SIMULATED, ids=[f"{p}-{l.world_size}-r{r}" for p, l, r, _ in SIMULATED]
)
def test_estimate_equals_simulation(preset: str, layout: MeshLayout, rank: int, precision: str) -> None:
    config = GPTConfig.from_preset(preset)
    simulated = simulate_rank(config, layout, rank, precision)
    estimate = state_bytes(gpt_shapes(config), layout, precision, rank)
    assert {k: simulated[k] for k in COMPONENTS} == estimate
    assert estimate["params"] > 0 or layout.dp_shard == 1000


def test_tied_embeddings_count_once_and_rule_out_pp() -> None:
    tied, untied = GPTConfig.from_preset("llama3.2-1b"), GPTConfig.from_preset("llama3.2-1b", tie_embeddings=False)
    assert gpt_shapes(tied).numel() == 1_235_814_400
    assert gpt_shapes(untied).numel() - gpt_shapes(tied).numel() == 128256 * 2048
    layout, work, hw = MeshLayout(pp=2, dp_shard=4), Workload(global_batch=64, seq_len=2048), Hardware(1, 8, 80 * GB)
    assert "pp with tied embeddings is not modelled" in why_invalid(layout, gpt_shapes(tied), work, hw)
    assert why_invalid(layout, gpt_shapes(untied), work, hw) is None


def test_fit_and_no_fit_examples(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    # 8B trains on one node of 80 GB; 405B (6.5 TB of fp32 weights, gradients and AdamW state) cannot
    _, eight_b, _ = _run(capsys, "--preset", "llama3-8b", "--devices", "8")
    _, big, text = _run(capsys, "--preset", "llama3-405b", "--devices", "8")
    assert eight_b["ranked"] and not big["ranked"]
    assert "nothing fits" in text
    # no plan, no rehearsal: an error, not a silent skip
    rehearsal = tmp_path / "r.yaml"
    with pytest.raises(SystemExit, match="r.yaml: no layout fits, so there is no plan to rehearse"):
        plan_main(["--preset", "llama3-405b", "--devices", "8", "--rehearsal", str(rehearsal)])
    assert not rehearsal.exists()


BAD_ARGUMENTS = [
    *[
        (
            [flag, value, "--devices", "8"][: 2 if flag in ("--devices", "--nodes") else 4],
            f"argument {flag}: {value} is not",
        )
        for flag in (
            "--seq-len",
            "--global-batch",
            "--devices",
            "--nodes",
            "--devices-per-node",
            "--tp",
            "--pp",
            "--top",
            "--max-steps",
            "--ep",
        )
        for value in ("0", "-3")
    ],
    (["--devices", "8", "--seq-len", "1.5"], "argument --seq-len: '1.5' is not an integer >= 1"),
    (["--devices", "eight"], "argument --devices: 'eight' is not an integer >= 1"),
    *[
        (["--devices", "8", flag, value], f"argument {flag}: {value} is not a number > 0")
        for flag in ("--peak-tflops", "--memory-gb", "--memory-tbps", "--intra-node-gbps", "--inter-node-gbps")
        for value in ("0", "-1", "nan")
    ],
    *[
        (["--devices", "8", flag, "-1"], f"argument {flag}: -1 is not a number >= 0")
        for flag in ("--reserve-gib", "--intra-node-latency-us", "--inter-node-latency-us")
    ],
    (["--devices", "8", "--efficiency", "1.5"], "argument --efficiency: 1.5 is not a number > 0 and <= 1"),
    (["--devices", "8", "--efficiency", "0"], "argument --efficiency: 0 is not a number > 0 and <= 1"),
    (
        ["--devices", "8", "--seq-len", "16384"],
        "--seq-len 16384 exceeds the model's max_seq_len=8192 (llama3-8b): give --seq-len <= 8192, or raise it with"
        " --config-overrides '{max_seq_len: 16384}'",
    ),
    (
        ["--devices", "8", "--config-overrides", "{max_seq_len: 1024}", "--seq-len", "2048"],
        "exceeds the model's max_seq_len=1024 (llama3-8b with the overrides)",
    ),
    (
        ["--devices", "8", "--nodes", "2", "--devices-per-node", "8"],
        "--devices 8 disagrees with --nodes 2 x --devices-per-node 8 = 16: give two of the three, or make them agree",
    ),
    (["--devices", "8", "--nodes", "3"], "--devices 8 do not spread evenly over --nodes 3"),
    (
        ["--devices", "12"],
        "--devices 12 is not --nodes x --devices-per-node (8): give a multiple of 8, or set --nodes N",
    ),
    (["--devices", "4"], "set --devices-per-node 4 for one node"),
    ([], "give --devices N (or --nodes N)"),
    (["--devices", "8", "--memory-gb", "2"], "--memory-gb 2 leaves nothing after the reserve of --reserve-gib 4"),
    (["--devices", "8", "--preset", "llama4"], "unknown gpt preset 'llama4'; choose one of ['llama3-405b'"),
    (["--devices", "8", "--config-overrides", "{layers: 4}"], "must map GPTConfig fields (vocab_size, dim"),
    (["--devices", "8", "--config-overrides", "{n_layers: ["], "--config-overrides '{n_layers: [' is not YAML"),
    (
        [
            "--devices",
            "8",
            "--model",
            "moe",
            "--preset",
            "tiny",
            "--config-overrides",
            "{moe_every: 2}",
            "--seq-len",
            "64",
        ],
        "moe_every=2: the planner models identical blocks",
    ),
    (["--devices", "8", "--ep", "2"], "--ep 2 needs an MoE model (--model moe)"),
    (["--devices", "8", "--routing-cv", "2"], "--routing-cv 2 describes an MoE router (--model moe); drop it here"),
    (["--devices", "8", "--routing-cv", "-1"], "argument --routing-cv"),
    (
        ["--devices", "8", "--model", "llama"],
        "--model llama: no model family named 'llama'; the registered and installed",
    ),
    (["--devices", "8", "--tp", "3"], "--tp 3: the fixed degrees must be >= 1 and their product must divide the 8"),
    (["--devices", "8", "--tp", "4", "--pp", "4"], "product must divide the 8 devices"),
    (
        ["--devices", "8", "--float8", "fp8"],
        "argument --float8: invalid choice: 'fp8' (choose from 'tensorwise', 'rowwise')",
    ),
    (
        ["--devices", "8", "--preset", "tiny", "--seq-len", "64", "--out", "/proc/no/such/dir/x.yaml"],
        "--out /proc/no/such/dir/x.yaml: cannot write it",
    ),
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_ARGUMENTS, ids=[" ".join(a) or "no-devices" for a, _ in BAD_ARGUMENTS]
)
def test_bad_plan_arguments_exit_2_naming_the_value_and_the_fix(
    capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        plan_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err


def test_devices_and_nodes_give_the_devices_per_node(capsys: pytest.CaptureFixture) -> None:
    status, out, text = _run(capsys, "--preset", "tiny", "--seq-len", "64", "--devices", "8", "--nodes", "2")
    assert status == 0 and "on 8 devices (2 nodes x 4)" in text
    status, out, text = _run(capsys, "--preset", "tiny", "--seq-len", "64", "--nodes", "2", "--devices-per-node", "2")
    assert status == 0 and "on 4 devices (2 nodes x 2)" in text


def test_nothing_fits_exits_1(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        from lit_mesh.cli import run

        run(["plan", "--preset", "llama3-405b", "--devices", "8"])
    assert exit_.value.code == 1 and "nothing fits" in capsys.readouterr().out


KERNELS = dict(
    gemm_peak_fraction=0.5,
    gemm_half_size=64,
    attention_peak_fraction=0.25,
    elementwise_accesses=10,
    elementwise_accesses_compiled=4,
    adamw_bytes_per_parameter=32,
    float8_gemm_peak_fraction=0.4,
    float8_cast_accesses=3,
    float8_rowwise_cast_accesses=6,
)


def test_step_time_parts_by_hand() -> None:
    """Tiny GPT, fp32, FSDP 8 on one node and FSDP 2 across two nodes: each compute part from its formula, the
    FSDP gathers exposed only where they outlast the previous block's compute."""
    from lit_mesh.planner.cost import Kernels, step_time

    config, kernels = GPTConfig.from_preset("tiny"), Kernels(**KERNELS)
    shapes, work = gpt_shapes(config), Workload(global_batch=16, seq_len=64, micro_batch=2)
    hw = Hardware(
        nodes=1,
        devices_per_node=8,
        memory_bytes=80 * GB,
        peak_flops=1e12,
        memory_bandwidth=1e11,
        intra_node_bandwidth=100e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=10e9,
        inter_node_latency=1e-5,
    )
    t = step_time(shapes, MeshLayout(dp_shard=8), work, "32-true", "full", hw, kernels=kernels)
    eff = lambda n, k: 0.5 * n / (n + 64) * k / (k + 64)  # noqa: E731
    tokens = 2 * 64  # one micro-batch of 2 sequences per rank
    gemm = sum(
        6 * tokens * n * k / (1e12 * eff(n, k))
        for n, k in [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (64, 128), (128, 64)]
    )
    attention = 0.5 * 12 * tokens * 64 * 64 / (1e12 * 0.25)
    elementwise = tokens * (64 + 128) * 10 * 4 / 1e11
    block = (gemm + attention + elementwise) * 4 / 3  # full AC: the forward again
    head = 6 * tokens * 256 * 64 / (1e12 * eff(256, 64))
    assert t.compute_parts["gemm"] == pytest.approx(2 * gemm + head)
    assert t.compute_parts["attention"] == pytest.approx(2 * attention)
    assert t.compute_parts["elementwise"] == pytest.approx(2 * elementwise)
    assert t.compute == pytest.approx(2 * block + head)
    ring = lambda nbytes, k, bw, alpha: (k - 1) * alpha + (k - 1) / k * nbytes / bw  # noqa: E731
    block_params = sum(p.numel() for p in GPT(config).layers[0].parameters())
    gather = ring(4 * block_params, 8, 100e9, 1e-6)
    forward, backward = block / 3, 2 * block / 3
    exposed = gather + max(0, gather - forward) + 2 * max(0, 2 * gather - backward)  # gather + reduce-scatter
    assert t.exposed["fsdp"] == pytest.approx(exposed)
    assert t.total == pytest.approx(t.compute + exposed + t.optimizer)
    # two nodes of one device: the FSDP group crosses nodes; 8 sequences per rank in 4 micro-batches of 2, the
    # gathers slow enough to show: each outlasts its block
    two_nodes = dataclasses.replace(hw, nodes=2, devices_per_node=1, inter_node_bandwidth=1e8)
    t2 = step_time(shapes, MeshLayout(dp_shard=2), work, "32-true", "none", two_nodes, kernels=kernels)
    block2 = gemm + attention + elementwise
    g2 = ring(4 * block_params, 2, 1e8, 1e-5)
    assert g2 > 2 * block2
    per_micro = g2 + (g2 - block2 / 3) + (g2 - 2 * block2 / 3)  # the last block's backward reuses its gather
    last = 2 * (2 * g2 - 2 * block2 / 3) - (g2 - 2 * block2 / 3)  # the last backward also reduce-scatters
    assert t2.exposed["fsdp"] == pytest.approx(4 * per_micro + last)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_step_time_by_hand(recipe: str) -> None:
    """MeshStrategy(float8=...) in the time model: the blocks' linears at twice the peak and the float8 fraction,
    their inputs' and output gradients' casts memory bound, the head in bf16; tensorwise gathers the linears'
    weights in float8 (one byte) under FSDP, rowwise in the gather dtype."""
    from lit_mesh.planner.cost import Features, Kernels, step_time

    config, kernels = GPTConfig.from_preset("tiny"), Kernels(**KERNELS)
    shapes, work = gpt_shapes(config), Workload(global_batch=16, seq_len=64, micro_batch=2)
    hw = Hardware(nodes=1, devices_per_node=8, memory_bytes=80 * GB, peak_flops=1e12, memory_bandwidth=1e11)
    layout = MeshLayout(dp_shard=8)
    t = step_time(shapes, layout, work, "bf16-mixed", "full", hw, Features(float8=recipe), kernels)
    size = lambda n, k: n / (n + 64) * k / (k + 64)  # noqa: E731
    tokens = 2 * 64
    linears = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (64, 128), (128, 64)]  # wq wk wv wo w1 w2 w3
    gemm = sum(6 * tokens * n * k / (2e12 * 0.4 * size(n, k)) for n, k in linears)
    head = 6 * tokens * 256 * 64 / (1e12 * 0.5 * size(256, 64))  # outside the blocks: bf16
    casts = tokens * sum(n + k for n, k in linears) * {"tensorwise": 3, "rowwise": 6}[recipe] / 1e11
    assert t.compute_parts["gemm"] == pytest.approx(2 * gemm + head)
    assert t.compute_parts["float8_casts"] == pytest.approx(2 * casts)
    # FSDP: one micro-batch, 2 blocks: each gathered in forward and backward, reduce-scattered in fp32
    bf16 = step_time(shapes, layout, work, "bf16-mixed", "full", hw, Features(), kernels)
    block_params = sum(p.numel() for p in GPT(config).layers[0].parameters())
    linear_params = sum(n * k for n, k in linears)
    ring = lambda nbytes: 7 * 5e-6 + 7 / 8 * nbytes / hw.intra_node_bandwidth  # noqa: E731
    gathered = 2 * block_params - (linear_params if recipe == "tensorwise" else 0)
    saved = 2 * 2 - 1  # (2 blocks x 2 gathers) - the last block's kept gather, as bytes fewer each
    assert bf16.overlapped["fsdp"] - t.overlapped["fsdp"] == pytest.approx(
        saved * (ring(2 * block_params) - ring(gathered))
    )


def test_gemm_efficiency_falls_with_tp_and_async_tp_hides_the_forward() -> None:
    from lit_mesh.planner.cost import Features, calibrated_kernels, step_time

    shapes, work = gpt_shapes(GPTConfig.from_preset("llama3-8b")), Workload(global_batch=8, seq_len=8192, micro_batch=1)
    hw = Hardware(nodes=1, devices_per_node=8, memory_bytes=80 * GB)
    kernels = calibrated_kernels()
    assert kernels.gemm_efficiency(4096, 4096) > kernels.gemm_efficiency(512, 4096) > kernels.gemm_efficiency(128, 4096)
    fsdp = step_time(shapes, MeshLayout(dp_shard=8), work, "bf16-mixed", "none", hw)
    tp = step_time(shapes, MeshLayout(tp=8), work, "bf16-mixed", "none", hw)
    # tp=8 runs 8 x the tokens through 1/8 of each weight: the same FLOPs per rank, in smaller, slower GEMMs
    assert tp.compute_parts["gemm"] > 1.2 * fsdp.compute_parts["gemm"]
    asynchronous = step_time(shapes, MeshLayout(tp=8), work, "bf16-mixed", "none", hw, Features(async_tp=True))
    from lit_mesh.comm.topology import all_gather_time

    # per block 8 collectives of the (tokens, dim) activations and, eager without AC, the backward's 2 re-gathers;
    # 4 of them exposed under async TP (compiled: no re-gather); the embedding's output and the head's input 4 more
    # (the loss runs on vocabulary shards: no logits gathered); 8 micro-batches
    hidden = all_gather_time(8192 * 4096 * 2, 8, hw.link(1, 8))
    assert tp.exposed["tp"] == pytest.approx(8 * (32 * 10 + 4) * hidden)
    assert asynchronous.exposed["tp"] == pytest.approx(8 * (32 * 4 + 4) * hidden)


@pytest.mark.parametrize(
    ("schedule", "v", "bubble"),
    [
        ("gpipe", 1, 3 / 8),
        ("1f1b", 1, 3 / 8),
        ("interleaved_1f1b", 2, 3 / 16),
        ("looped_bfs", 4, 3 / 32),
        ("zero_bubble", 2, 3 / 48),
        ("zbv", 2, 2 / 24),
        ("dualpipev", 2, 2 / 24),
    ],
)
def test_bubble_of_every_schedule(schedule: str, v: int, bubble: float) -> None:
    from lit_mesh.parallel.pipeline.schedules import SCHEDULES
    from lit_mesh.planner.cost import Schedule, bubble_fraction

    assert schedule in SCHEDULES  # every schedule lit_mesh runs has a bubble formula
    assert bubble_fraction(Schedule(schedule, v), pp=4, microbatches=8) == pytest.approx(bubble)
    assert bubble_fraction(Schedule(schedule, v), pp=1, microbatches=8) == 0


def test_calibration_runs_within_tolerance_with_one_model() -> None:
    """torchtitan's Llama 3 runs on H100 (calibration: +-20%) and the held-out ones (the 8B on 128 GPUs, 8B
    FSDP 8 x TP 8, Llama 3 405B at 8,192 GPUs from the paper, every published MoE layout: +-25%), every one with the
    same kernel constants."""
    from lit_mesh.planner.calibration import TOLERANCE, check, runs

    checks = [check(r) for r in runs()]
    assert {c.role for c in checks} == {"calibration", "held-out"} and len(checks) >= 7
    for c in checks:
        assert c.source and abs(c.ratio - 1) <= TOLERANCE[c.role], (c.name, c.published, c.estimated)


def test_rows_publishing_tokens_and_tflops_agree_with_their_flops_count() -> None:
    """Where a run publishes both tokens/s and TFLOP/s per device, the FLOPs per token its `flops_counted` names
    (the zoo's dense count, or Megatron-Core's causal one) turn one into the other within 1%."""
    from lit_mesh.planner.calibration import published_flops_per_token, runs, shapes_of

    both = [r for r in runs() if "tokens_per_s_per_device" in r and "tflops_per_device" in r]
    assert both
    for r in both:
        flops = published_flops_per_token(
            shapes_of(r["preset"], r.get("model", "gpt")), r["seq_len"], r.get("flops_counted", "dense")
        )
        assert r["tokens_per_s_per_device"] * flops / 1e12 == pytest.approx(r["tflops_per_device"], rel=0.01), r
        dense = published_flops_per_token(shapes_of(r["preset"], r.get("model", "gpt")), r["seq_len"])
        assert r["tokens_per_s_per_device"] * dense / 1e12 > 1.1 * r["tflops_per_device"]  # the count matters
    with pytest.raises(ValueError, match="flops_counted='sparse'"):
        published_flops_per_token(shapes_of("tiny"), 64, "sparse")


# MoE (zoo.moe, Mixtral-8x7B shapes): experts split over ep, then FSDP over the rest of dp_shard x cp by dim 1;
# 64, 512 and 1024 ranks, HSDP x TP, CP x TP, and ep = 1 (the experts FSDP-sharded over all 64 ranks); whole
# experts under tp (expert_tp=1: ep over the innermost ranks of dp_shard x cp x tp, FSDP over the rest)
SIMULATED_MOE = [
    (MeshLayout(dp_shard=64, ep=8), 63, "bf16-mixed", None),
    (MeshLayout(dp_replicate=4, dp_shard=16, tp=8, ep=4), 511, "bf16-mixed", None),
    (MeshLayout(dp_shard=64, cp=2, tp=8, ep=8), 1023, "bf16-true", None),
    (MeshLayout(dp_shard=64), 5, "32-true", None),
    (MeshLayout(dp_replicate=4, dp_shard=16, tp=8, ep=4), 509, "bf16-mixed", 1),
    (MeshLayout(dp_shard=64, cp=2, tp=8, ep=8), 1021, "bf16-true", 1),
]


@pytest.mark.parametrize(
    ("layout", "rank", "precision", "expert_tp"),
    SIMULATED_MOE,
    ids=[f"mixtral-{l.world_size}-ep{l.ep}-r{r}{'-whole' if e else ''}" for l, r, _, e in SIMULATED_MOE],
)
def test_moe_estimate_equals_simulation(layout: MeshLayout, rank: int, precision: str, expert_tp: int | None) -> None:
    config = MoEConfig.from_preset("mixtral-8x7b")
    simulated = simulate_rank(config, layout, rank, precision, expert_tp=expert_tp)
    shapes = gpt_shapes(config).with_whole_experts() if expert_tp == 1 else gpt_shapes(config)
    assert {k: simulated[k] for k in COMPONENTS} == state_bytes(shapes, layout, precision, rank)


def test_moe_layouts_that_fsdp_cannot_shard_evenly_are_refused() -> None:
    # 1000-way FSDP with ep 8 leaves 125 expert_dp ranks, which do not divide dim 1 (4096) of the expert weights
    config = MoEConfig.from_preset("mixtral-8x7b")
    layout = MeshLayout(dp_shard=1000, ep=8)
    hw = Hardware(nodes=125, devices_per_node=8, memory_bytes=80 * GB)
    reason = why_invalid(layout, gpt_shapes(config), Workload(global_batch=1000, seq_len=8192), hw)
    assert reason is not None and "dim 1" in reason
    # the real sharding refuses it too, before FSDP2 would (NotImplementedError: uneven sharding on dim 1)
    with pytest.raises(
        PlanError,
        match=r"by its dim 1 \(4096\) over dp_shard x cp / ep = 1000 x 1 / 8 = 125 ranks.*choose expert sizes divisible by 125",
    ):
        simulate_rank(config, layout, 999, "32-true", optimizer=False)


def test_moe_pipeline_layouts_are_proposed_and_simulated(capsys: pytest.CaptureFixture) -> None:
    """pp x MoE at Megatron's Mixtral mapping (tp1 x ep8 x pp4) on 32 devices: proposed where it fits, with the
    routing pass in its step time, and `--simulate` finds the estimate equal to the real sharding of each stage."""
    status, out, text = _run(
        capsys,
        "--model",
        "moe",
        "--preset",
        "mixtral-8x7b",
        "--devices",
        "32",
        "--pp",
        "4",
        "--tp",
        "1",
        "--global-batch",
        "64",
        "--seq-len",
        "4096",
        "--simulate",
    )
    best = out["ranked"][0]["layout"]
    assert status == 0 and best["pp"] == 4 and best["tp"] == 1 and best["ep"] > 1, text
    assert "MoE routing pass" in text
    stages = {row["stage"] for row in out["simulation"]}
    assert {0, 3} <= stages and all(row["equal"] for row in out["simulation"]), text
    # without a fixed pp the same layouts are weighed, not rejected
    config = MoEConfig.from_preset("mixtral-8x7b")
    layout = MeshLayout(pp=4, dp_shard=8, ep=8)
    hw = Hardware(nodes=4, devices_per_node=8, memory_bytes=80 * GB)
    assert why_invalid(layout, gpt_shapes(config), Workload(global_batch=64, seq_len=4096), hw) is None


def test_moe_all_to_all_in_the_step_time_by_hand() -> None:
    """Tiny MoE, fsdp 4 with ep 4 on one node: per MoE block and micro-batch, dispatch + combine forward and
    backward move top_k copies of every token of the micro-batch (the dispatch with each copy's router weight as
    one more column); ring cost (k-1) alpha + (k-1)/k B / bandwidth."""
    from lit_mesh.planner.cost import step_time

    config = MoEConfig.from_preset("tiny")
    shapes, work = gpt_shapes(config), Workload(global_batch=16, seq_len=64, micro_batch=2)
    hw = Hardware(
        nodes=1,
        devices_per_node=4,
        memory_bytes=80 * GB,
        peak_flops=1e12,
        compute_efficiency=0.5,
        intra_node_bandwidth=100e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=10e9,
        inter_node_latency=1e-5,
    )
    t = step_time(shapes, MeshLayout(dp_shard=4, ep=4), work, "32-true", "none", hw)
    routed = 2 * 64 * config.top_k * config.dim * 4  # bytes of one micro-batch's routed tokens, fp32
    microbatches = 16 // 4 // 2
    dispatched = routed * (config.dim + 1) // config.dim
    per_block = 2 * (3 * 1e-6 + 3 / 4 * routed / 100e9) + 2 * (3 * 1e-6 + 3 / 4 * dispatched / 100e9)
    assert t.exposed["ep"] == pytest.approx(microbatches * config.n_layers * per_block)
    assert "ep" not in step_time(shapes, MeshLayout(dp_shard=4), work, "32-true", "none", hw).exposed


def test_expert_tensor_parallel_in_memory_and_cost() -> None:
    """tp splits each expert's hidden units (expert tensor parallel): a rank holds 1/tp of every expert weight (FSDP
    then shards w2 by dim 2, tp holding its dim 1), does 1/tp of the expert GEMMs, and sums the partial outputs
    over tp (two all-reduces of the routed tokens per MoE block). The same shapes with replicated experts: none of it."""
    from lit_mesh.comm.topology import all_reduce_time
    from lit_mesh.planner.cost import _gemm_seconds, calibrated_kernels, step_time
    from lit_mesh.planner.memory import local_numel

    config = MoEConfig.from_preset("tiny")
    shapes = gpt_shapes(config)
    experts = [p for p in shapes.block if p.expert]
    assert shapes.expert_tp and {p.name.rsplit(".", 1)[1]: p.hidden_dim for p in experts} == {"w1": 2, "w3": 2, "w2": 1}
    replicated = dataclasses.replace(shapes, block=tuple(dataclasses.replace(p, hidden_dim=None) for p in shapes.block))
    for p in experts:  # (4, 64, 64): ep 2 -> 2 experts; tp 2 -> 32 hidden units; 2 FSDP shards of the dim of 64
        assert local_numel(p, 2, 1, 4, 3, ep=2) == 2 * 64 * 32 // 2 == local_numel(p, 1, 0, 4, 3, ep=2) // 2, p
    e = {"w1": 0, "w3": 1, "w2": 2}
    assert [local_numel(p, 2, 0, 4, 0, ep=2) for p in sorted(experts, key=lambda p: e[p.name.rsplit(".", 1)[1]])] == [
        2048
    ] * 3
    flat = dataclasses.replace(
        calibrated_kernels(), gemm_half_size=0
    )  # the same efficiency at any GEMM size: FLOPs alone
    assert _gemm_seconds(tuple(experts), 128, 2, 1, 2, flat, 1e12) == pytest.approx(
        _gemm_seconds(tuple(experts), 128, 1, 1, 2, flat, 1e12) / 2
    )
    layout, work = MeshLayout(dp_shard=2, tp=2), Workload(global_batch=8, seq_len=64, micro_batch=2)
    hw = Hardware(nodes=1, devices_per_node=4, memory_bytes=80 * GB, peak_flops=1e12, compute_efficiency=0.5)
    with_etp, without = (step_time(s, layout, work, "32-true", "none", hw) for s in (shapes, replicated))
    routed = 2 * 64 * config.top_k * config.dim * 4
    microbatches = 8 // 2 // 2
    extra = microbatches * config.n_layers * 2 * all_reduce_time(routed, 2, hw.link(1, 2))
    assert with_etp.exposed["tp"] - without.exposed["tp"] == pytest.approx(extra)
    assert with_etp.compute_parts["gemm"] < without.compute_parts["gemm"]
    assert state_bytes(shapes, layout, "32-true")["params"] < state_bytes(replicated, layout, "32-true")["params"]


def test_pp_x_cp_is_proposed_with_per_stage_terms_and_simulated(capsys: pytest.CaptureFixture) -> None:
    """Long sequences: pp x cp layouts are proposed where they fit, MeshStrategy takes them; each stage keeps the
    activations of T/cp tokens per micro-batch (as pp alone on sequences of T/cp) and runs the CP ring over its own
    blocks only; `--simulate` checks the sharding of a pp x cp plan on fake ranks, stage by stage."""
    from lit_mesh.planner.cost import step_time
    from lit_mesh.planner.memory import activation_bytes

    seq_len = 131072
    config = dataclasses.replace(GPTConfig.from_preset("llama3-8b"), max_seq_len=seq_len)
    shapes, work, hw = (
        gpt_shapes(config),
        Workload(global_batch=8, seq_len=seq_len),
        Hardware(nodes=2, memory_bytes=80 * GB),
    )
    both = [c for c in plan(shapes, work, hw).ranked if c.layout.pp > 1 and c.layout.cp > 1]
    assert both and all(c.fits(hw) for c in both)
    c = both[0]
    layout, precision, ac = c.layout, c.precision, c.ac
    MeshStrategy(**fit_config(c, "llama3-8b", {}, hw, 10)["trainer"]["strategy"]["init_args"])
    shorter = dataclasses.replace(c.work, seq_len=seq_len // layout.cp)
    for stage in range(layout.pp):
        assert activation_bytes(shapes, layout, c.work, precision, ac, stage) == activation_bytes(
            shapes, dataclasses.replace(layout, cp=1), shorter, precision, ac, stage
        )
    ring = step_time(shapes, layout, c.work, precision, ac, hw).overlapped["cp"]
    whole_model_ring = step_time(shapes, dataclasses.replace(layout, pp=1), c.work, precision, ac, hw).overlapped["cp"]
    assert ring == pytest.approx(whole_model_ring * max(balanced_split(config.n_layers, layout.pp)) / config.n_layers)
    exchanged = f"({c.work.micro_batch}, {seq_len // (layout.cp * layout.tp)}, {config.dim})"
    assert any(f"stages exchange activations of {exchanged}" in r for r in c.reasons), c.reasons

    status, out, text = _run(
        capsys,
        "--preset",
        "llama3-8b",
        "--devices",
        "16",
        "--seq-len",
        str(seq_len),
        "--global-batch",
        "8",
        "--config-overrides",
        f"{{max_seq_len: {seq_len}}}",
        "--pp",
        "2",
        "--cp",
        "8",
        "--simulate",
        "--top",
        "1",
    )
    assert status == 0, text
    assert out["ranked"][0]["layout"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 8, "tp": 1, "ep": 1}
    assert [r["stage"] for r in out["simulation"]] == [0, 1] and all(r["equal"] for r in out["simulation"]), text


def test_ties_go_to_less_exposed_communication_then_fewer_dims() -> None:
    from lit_mesh.planner.cost import StepTime
    from lit_mesh.planner.search import Candidate, rank

    def option(layout: MeshLayout, total: float, exposed: float, memory: int = 1) -> Candidate:
        t = StepTime(compute_parts={"gemm": total - exposed}, exposed={"tp": exposed} if exposed else {})
        return Candidate(layout, "bf16-mixed", "none", Workload(8, 64), {"total": memory}, t, 0.0, 0.0)

    slower = option(MeshLayout(dp_shard=8), 1.05, 0.0)
    busy = option(MeshLayout(dp_shard=2, tp=4), 1.0, 0.1)  # fastest, but 10% of it exposed communication
    quiet_3d = option(MeshLayout(dp_shard=2, cp=2, tp=2), 1.01, 0.0)
    quiet_2d = option(MeshLayout(dp_shard=4, cp=2), 1.015, 0.0, memory=2)  # more memory, one dim fewer
    assert rank([slower, busy, quiet_3d, quiet_2d]) == [quiet_2d, quiet_3d, busy, slower]


def test_cp_only_where_each_rank_keeps_enough_tokens() -> None:
    """512 tokens per rank across nodes (cp=16 of 8192) is refused: the ring would not hide its K/V exchange;
    the same sequence over cp=2 inside a node is allowed."""
    from lit_mesh.planner.search import cp_min_tokens

    shapes, work = gpt_shapes(GPTConfig.from_preset("llama3-8b")), Workload(global_batch=256, seq_len=8192)
    hw = Hardware(nodes=4, devices_per_node=8, memory_bytes=80 * GB)
    across = MeshLayout(dp_shard=2, cp=16)
    assert cp_min_tokens(shapes, across, hw) > 8192 // 16
    assert why_invalid(across, shapes, work, hw) is None  # lit_mesh runs it, but it is not worth proposing
    assert "fewer than" in (why_wasteful(across, shapes, work, hw) or "")
    assert why_wasteful(MeshLayout(dp_shard=16, cp=2), shapes, work, hw) is None
    result = plan(shapes, work, hw)
    assert all(work.seq_len // c.layout.cp >= cp_min_tokens(shapes, c.layout, hw) for c in result.ranked)


def test_zero_stages_in_memory_step_time_search_and_config(tmp_path: Path) -> None:
    """ZeRO-1/2 (#24): the same shards, every unit gathered for the whole step (buffers), ZeRO-1's whole
    gradients while accumulating; one gather per step, reductions every micro-batch (2) or once (1); searched
    when asked, refused where MeshStrategy refuses it, written into the YAML."""
    from lit_mesh.planner.cost import Features, Kernels, step_time
    from lit_mesh.planner.memory import rank_memory
    from lit_mesh.planner.search import why_not_zero_stage

    config = dataclasses.replace(GPTConfig.from_preset("tiny"), n_layers=4)
    shapes, work = gpt_shapes(config), Workload(global_batch=16, seq_len=64, micro_batch=2)  # 4 micro-batches
    layout, numel = MeshLayout(dp_shard=2), sum(p.numel() for p in GPT(config).parameters())
    mem = {z: rank_memory(shapes, layout, work, "32-true", "none", z) for z in (1, 2, 3)}
    assert mem[1]["params"] == mem[2]["params"] == mem[3]["params"] == 4 * numel // 2  # the same shards
    assert mem[1]["optimizer"] == mem[2]["optimizer"] == mem[3]["optimizer"] == 8 * numel // 2
    assert mem[2]["grads"] == mem[3]["grads"] == 4 * numel // 2 and mem[1]["grads"] == 4 * numel  # accumulating whole
    block = sum(p.numel() for p in GPT(config).layers[0].parameters())
    assert mem[2]["buffers"] == mem[1]["buffers"] == 4 * numel + 4 * block  # everything gathered + one block's grad
    assert mem[3]["buffers"] < mem[2]["buffers"]  # stage 3: two blocks and the root at a time
    one_micro = Workload(global_batch=4, seq_len=64, micro_batch=2)
    assert (
        rank_memory(shapes, layout, one_micro, "32-true", "none", 1)["grads"] == 4 * numel // 2
    )  # nothing to accumulate

    hw = Hardware(
        nodes=2,
        devices_per_node=1,
        memory_bytes=80 * GB,
        peak_flops=1e12,
        memory_bandwidth=1e11,
        intra_node_bandwidth=100e9,
        intra_node_latency=1e-6,
        inter_node_bandwidth=1e8,
        inter_node_latency=1e-5,
    )
    kernels = Kernels(**KERNELS)
    t = {z: step_time(shapes, layout, work, "32-true", "none", hw, Features(zero_stage=z), kernels) for z in (1, 2, 3)}
    assert t[1].compute == t[2].compute == t[3].compute
    ring = lambda nbytes, k, bw, alpha: (k - 1) * alpha + (k - 1) / k * nbytes / bw  # noqa: E731
    eff = lambda n, k: 0.5 * n / (n + 64) * k / (k + 64)  # noqa: E731
    head = 6 * 2 * 64 * 256 * 64 / (1e12 * eff(256, 64))  # per micro-batch of 2 x 64 tokens
    g, b = ring(4 * block, 2, 1e8, 1e-5), (t[3].compute / 4 - head) / config.n_layers  # per block and micro-batch
    forward, backward = b / 3, 2 * b / 3
    once = g + (g - forward) * (config.n_layers - 1)  # the step's one gather pass
    assert t[2].exposed["fsdp"] == pytest.approx(once + 4 * (g - backward) * config.n_layers)
    assert t[1].exposed["fsdp"] == pytest.approx(once + (g - backward) * config.n_layers)
    assert t[1].total < t[2].total < t[3].total  # a slow network: each stage down communicates less

    assert why_not_zero_stage(MeshLayout(dp_replicate=2), 2) and why_not_zero_stage(MeshLayout(pp=2, dp_shard=2), 1)
    assert why_not_zero_stage(MeshLayout(dp_replicate=2, dp_shard=2), 1) is None
    slower = dataclasses.replace(hw, inter_node_bandwidth=1e6)  # the gathers outlast the compute: fewer is faster
    result = plan(shapes, work, slower, ["32-true"], ["none"], {"dp_shard": 2}, zero_stages=(3, 2, 1))
    assert sorted(c.zero_stage for c in result.ranked) == [1, 2, 3] and result.ranked[-1].zero_stage == 3
    best = result.ranked[0]
    assert best.zero_stage < 3 and f"ZeRO-{best.zero_stage}" in best.name()
    assert all(c.zero_stage == 3 for c in plan(shapes, work, hw, ["32-true"], ["none"]).ranked)  # default: FSDP only
    strategy = fit_config(best, "tiny", {}, hw, 10)["trainer"]["strategy"]["init_args"]
    assert strategy["zero_stage"] == best.zero_stage
    assert (
        MeshStrategy(**{k: v for k, v in strategy.items() if k != "topology"}).options.data.zero_stage
        == best.zero_stage
    )


# ---- pipeline schedules with v stages per rank (#26 item 4) ----------------------------------------------------


def _torch_order(schedule: str, pp: int, v: int, n: int) -> dict[int, list]:
    """torch's own `pipeline_order` of every pp rank, built from stub stages (the orders depend only on pp, v, n)."""
    from types import SimpleNamespace

    from lit_mesh.parallel.pipeline.schedules import SCHEDULES

    stages = [
        SimpleNamespace(
            group_size=pp, group_rank=0, num_stages=pp * v, submod=None, stage_index=i, is_first=i == 0, is_last=False
        )
        for i in range(v)
    ]
    cls, kind, _ = SCHEDULES[schedule]
    built = cls(stages[0] if kind == "one" else stages, n_microbatches=n, loss_fn=lambda *a: a[0])
    return built._get_pipeline_order() if kind == "one" else built.pipeline_order


def _leaf_actions(order: list) -> list:
    """A rank's actions, DualPipeV's overlapped forward-and-backward split into its two."""
    return [leaf for action in filter(None, order) for leaf in (action.sub_actions or (action,))]


def _torch_peaks(schedule: str, pp: int, v: int, n: int, weights: list[int] | None = None) -> list[int]:
    """Stage forwards each pp rank holds at its peak in torch's own schedule: +1 per forward, -1 per full backward
    or weight-gradient pass; with `weights`, +/- the weight of the action's (global) stage instead of 1."""
    from torch.distributed.pipelining.schedules import _ComputationType as Op

    change = {Op.FORWARD: 1, Op.FULL_BACKWARD: -1, Op.BACKWARD_WEIGHT: -1}
    peaks = []
    for actions in _torch_order(schedule, pp, v, n).values():
        held = peak = 0
        for action in _leaf_actions(actions):
            held += change.get(action.computation_type, 0) * (1 if weights is None else weights[action.stage_index])
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _torch_gradient_peaks(schedule: str, pp: int, v: int, n: int, weights: list[int]) -> list[int]:
    """The most weight of stages whose gradients are alive at once on each pp rank: a stage's from its first full
    backward or weight pass to its last (torch's schedules._add_reduce_grad reduces them after it)."""
    from torch.distributed.pipelining.schedules import _ComputationType as Op

    peaks = []
    for actions in _torch_order(schedule, pp, v, n).values():
        passes = [
            a.stage_index
            for a in _leaf_actions(actions)
            if a.computation_type in (Op.FULL_BACKWARD, Op.BACKWARD_WEIGHT)
        ]
        first = {g: passes.index(g) for g in set(passes)}
        last = {g: len(passes) - 1 - passes[::-1].index(g) for g in set(passes)}
        peaks.append(max(sum(weights[g] for g in first if first[g] <= i <= last[g]) for i in range(len(passes))))
    return peaks


@pytest.mark.parametrize(
    ("schedule", "v"),
    [
        ("1f1b", 1),
        ("gpipe", 1),
        ("interleaved_1f1b", 2),
        ("interleaved_1f1b", 3),
        ("looped_bfs", 2),
        ("zero_bubble", 2),
        ("zero_bubble", 3),
        ("zbv", 2),
        ("dualpipev", 2),
    ],
)
def test_in_flight_stage_forwards_match_torchs_schedules(schedule: str, v: int) -> None:
    from lit_mesh.planner.pipeline_model import Schedule, in_flight, microbatches_refused

    checked = 0
    for pp in (2, 4, 8):
        for n in (1, pp - 1, pp, pp + 2, 2 * pp, 3 * pp):
            if n < 1 or microbatches_refused(Schedule(schedule, v), pp, n):
                continue  # MeshStrategy refuses it (and the planner never proposes it)
            assert [in_flight(Schedule(schedule, v), pp, n, r) for r in range(pp)] == _torch_peaks(
                schedule, pp, v, n
            ), (pp, n)
            checked += 1
    assert checked >= 6


@pytest.mark.parametrize(
    ("schedule", "v"),
    [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zero_bubble", 2), ("looped_bfs", 2), ("zbv", 2)],
)
def test_held_blocks_weigh_each_stage_forward_by_its_stage(schedule: str, v: int) -> None:
    """Stages of unequal blocks (the split's first and last stage one fewer, or any): the blocks a rank keeps at its
    peak equal torch's order replayed with each stage forward weighted by its stage's blocks, and so do the most
    stages' gradients alive at once (looped_bfs, zbv: bounds)."""
    from lit_mesh.parallel.pipeline.schedules import SCHEDULES
    from lit_mesh.parallel.pipeline.split import stage_ranks
    from lit_mesh.planner.pipeline_model import Schedule, held_blocks, held_gradients, microbatches_refused, rank_stages

    checked = 0
    for pp in (2, 4, 8):
        for n in (pp, pp + 2, 2 * pp, 3 * pp):
            if microbatches_refused(Schedule(schedule, v), pp, n):
                continue
            for n_blocks in (pp * v * 3 - 2, pp * v * 2 + 1):  # the split's outer stages lighter, or one heavier
                stages = rank_stages(n_blocks, pp, Schedule(schedule, v))
                local = {r: iter(st.blocks) for r, st in enumerate(stages)}  # each rank's stages, ascending
                weights = [next(local[r]) for r in stage_ranks(pp * v, pp, SCHEDULES[schedule][2])]
                torch_peaks = _torch_peaks(schedule, pp, v, n, weights)
                ours = [held_blocks(Schedule(schedule, v), pp, n, r, stages[r].blocks) for r in range(pp)]
                grads = [held_gradients(Schedule(schedule, v), pp, n, r, stages[r].blocks) for r in range(pp)]
                torch_grads = _torch_gradient_peaks(schedule, pp, v, n, weights)
                if schedule in ("zbv", "looped_bfs"):  # a bound
                    assert all(o >= t for o, t in zip(ours, torch_peaks)), (pp, n, n_blocks, ours, torch_peaks)
                    assert all(o >= t for o, t in zip(grads, torch_grads)), (pp, n, n_blocks, grads, torch_grads)
                else:
                    assert ours == torch_peaks, (pp, n, n_blocks, ours, torch_peaks)
                    assert grads == torch_grads, (pp, n, n_blocks, grads, torch_grads)
                checked += 1
    assert checked >= 6


def test_interleaved_ranks_hold_the_same_parameters_and_more_activations() -> None:
    """v stages per rank: a rank's blocks add up to about the 1F1B stage's (the same parameters in total), the V
    puts the head on rank 0, and the interleaved warm-up holds more micro-batches' activations on rank 0."""
    from lit_mesh.planner.memory import activation_bytes, rank_memory, state_numel
    from lit_mesh.planner.pipeline_model import ONE_F_ONE_B, Schedule, rank_stages

    shapes, layout = gpt_shapes(GPTConfig.from_preset("llama3-70b")), MeshLayout(pp=4, dp_shard=2, tp=8)
    total = {
        s: sum(state_numel(shapes, layout, r * 16, schedule=s) for r in range(4))
        for s in (ONE_F_ONE_B, Schedule("interleaved_1f1b", 2), Schedule("zbv", 2))
    }
    assert len(set(total.values())) == 1  # every block, the embedding and the head once
    looped, v_shape = rank_stages(80, 4, Schedule("interleaved_1f1b", 2)), rank_stages(80, 4, Schedule("zbv", 2))
    # lit_mesh's balanced split of 8 stages fills from the front: 10, 11 x 6, 4 blocks
    assert [r.blocks for r in looped] == [(10, 11), (11, 11), (11, 11), (11, 4)] and looped[3].last and looped[0].first
    assert v_shape[0].first and v_shape[0].last and v_shape[0].blocks == (10, 4) and v_shape[1].blocks == (11, 11)
    work = Workload(64, 8192, 1)  # 8 per dp rank: 8 micro-batches
    one = activation_bytes(shapes, layout, work, "bf16-mixed", "selective", 0)
    two = activation_bytes(shapes, layout, work, "bf16-mixed", "selective", 0, schedule=Schedule("interleaved_1f1b", 2))
    # 1F1B: 4 micro-batches x 20 blocks; interleaved: (v-1) 4 + 2 (pp-1) + 1 = 11 stage forwards, in rounds of 4
    # per stage: 4 + 3 of the 10-block stage, 4 of the 11-block one
    assert two / one == pytest.approx((7 * 10 + 4 * 11) / (4 * 20), rel=1e-3)
    # the worst rank of a V: rank 1's 22 blocks x 8 stage forwards outweigh rank 0's 10 plus the head's logits
    assert rank_memory(shapes, layout, work, "bf16-mixed", "none", schedule=Schedule("zbv", 2))["stage"] == 1


def test_schedules_the_search_tries() -> None:
    from lit_mesh.planner.pipeline_model import Schedule, schedules_for

    tried = schedules_for(4, 80, "none")
    assert Schedule("interleaved_1f1b", 2) in tried and Schedule("interleaved_1f1b", 4) in tried
    assert Schedule("interleaved_1f1b", 3) not in tried  # 12 stages do not divide 80 blocks
    assert {Schedule("zero_bubble", 2), Schedule("zbv", 2), Schedule("dualpipev", 2)} <= set(tried)
    # split backward refuses checkpointed blocks (rules.split_backward_without_block_options)
    for ac in ("selective", "full"):
        assert {s.name for s in schedules_for(4, 80, ac)} == {"1f1b", "interleaved_1f1b"}
    assert schedules_for(8, 8, "none") == [Schedule()]  # one block per stage already
    assert schedules_for(1, 80, "none") == [Schedule()]


def _init_args(c, preset: str, hw: Hardware) -> dict:  # noqa: ANN001
    return fit_config(c, preset, {}, hw, 10)["trainer"]["strategy"]["init_args"]


def test_full_every_2nd_with_selective_between_sits_between_and_is_written() -> None:
    """ "full/2+selective" (ac_other_blocks="selective"): activations between full's and selective's, recompute
    between selective's and full's (no regathers), written as MeshStrategy's three arguments, which it accepts."""
    from lit_mesh.planner.search import evaluate

    shapes, work = gpt_shapes(GPTConfig.from_preset("llama3-70b")), Workload(256, 8192, 1)
    layout, hw = MeshLayout(dp_shard=32, tp=8), Hardware(nodes=32, devices_per_node=8, memory_bytes=80 * GB)
    by = {ac: evaluate(layout, shapes, work, hw, "bf16-mixed", ac) for ac in ("selective", "full/2+selective", "full")}
    acts = {ac: c.memory["activations"] for ac, c in by.items()}
    assert acts["full"] < acts["full/2+selective"] < acts["selective"]
    recompute = {ac: c.time.compute_parts["recompute"] for ac, c in by.items()}
    assert recompute["selective"] < recompute["full/2+selective"] < recompute["full"]
    args = _init_args(by["full/2+selective"], "llama3-70b", hw)
    assert (args["activation_checkpointing"], args["ac_every_n_blocks"], args["ac_other_blocks"]) == (
        "full",
        2,
        "selective",
    )
    MeshStrategy(**args)
    assert "ac_other_blocks" not in _init_args(evaluate(layout, shapes, work, hw, "bf16-mixed", "full/2"), "x", hw)


def test_interleaved_plan_for_llama3_405b_at_metas_layout_writes_its_schedule(tmp_path: Path) -> None:
    """Meta's TP 8 x PP 16 x DP 64: interleaving halves the 1F1B bubble; the plan names the schedule and v, prints
    both bubbles' terms, and writes pp_schedule, pp_stages_per_rank and pp_microbatches for `lit-mesh fit`."""
    from lit_mesh.planner.pipeline_model import Schedule
    from lit_mesh.planner.search import evaluate

    shapes, work = gpt_shapes(GPTConfig.from_preset("llama3-405b")), Workload(2048, 8192, 1)
    layout, hw = MeshLayout(pp=16, dp_shard=64, tp=8), Hardware(nodes=1024, devices_per_node=8, memory_bytes=80 * GB)
    one = evaluate(layout, shapes, work, hw, "bf16-mixed", "full")
    two = evaluate(layout, shapes, work, hw, "bf16-mixed", "full", schedule=Schedule("interleaved_1f1b", 2))
    assert one.time.bubble == pytest.approx(15 / 32) and two.time.bubble == pytest.approx(15 / 64)
    assert two.mfu > one.mfu and two.memory["activations"] > one.memory["activations"]
    # with full AC: 4 stages per rank, 2 blocks each (the embedding's and the head's stage 1: Llama 3's balance of
    # 126 blocks), quarter the 1F1B bubble
    best = plan(shapes, work, hw, ac_modes=("full",), fixed={"pp": 16, "tp": 8, "dp_shard": 64}).ranked[0]
    assert "interleaved_1f1b v=4" in best.name()
    from lit_mesh.planner.search import explain

    lines = explain(best, shapes, work, hw)
    assert any("schedule interleaved_1f1b, 4 stages per rank (64 in all)" in r and "bubble 11.7%" in r for r in lines)
    args = _init_args(best, "llama3-405b", hw)
    assert (args["pp_schedule"], args["pp_stages_per_rank"], args["pp_microbatches"]) == ("interleaved_1f1b", 4, 32)
    MeshStrategy(**args)
    scaled = rehearsal_config(best, hw)  # pp 2 x v 4 on the tiny GPT: deepened to 8 blocks
    assert scaled["model"]["init_args"]["config_overrides"] == {"n_layers": 8}
    MeshStrategy(**scaled["trainer"]["strategy"]["init_args"])


@pytest.mark.parametrize(
    ("schedule", "rank"),
    [(("interleaved_1f1b", 2), 32), (("zbv", 2), 0)],
    ids=["interleaved-v2-pp-rank-2", "zbv-embedding-and-head-rank"],
)
def test_estimate_equals_simulation_with_v_stages_per_rank(schedule: tuple[str, int], rank: int) -> None:
    """The stages lit_mesh builds for v stages per rank (looped: pp rank 2 runs stages 2 and 6 of 8; V: embedding
    and head both on pp rank 0) hold the bytes the planner counts."""
    from lit_mesh.planner.pipeline_model import Schedule

    config, layout = GPTConfig.from_preset("llama3-8b"), MeshLayout(pp=4, dp_shard=2, tp=8)
    simulated = simulate_rank(config, layout, rank, "bf16-mixed", schedule=Schedule(*schedule))
    estimate = state_bytes(gpt_shapes(config), layout, "bf16-mixed", rank, schedule=Schedule(*schedule))
    assert {k: simulated[k] for k in COMPONENTS} == estimate
    assert estimate != state_bytes(gpt_shapes(config), layout, "bf16-mixed", rank)  # 1F1B's stage differs


# ---- model families (lit_mesh/planner/families.py): the zoo registers its own; a user's comes by entry point -------

TOY_FAMILY_MODULE = """
import dataclasses
from lightning.pytorch import LightningModule

from lit_mesh.planner.families import ModelFamily
from zoo.gpt import GPT, GPTConfig


@dataclasses.dataclass
class ToyConfig(GPTConfig):  # a user's config: the zoo GPT's shape under another family
    pass


class ToyModule(LightningModule):
    pass


PRESETS = {"tiny": ToyConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64)}
TOY = ModelFamily(name="toy", config_class=ToyConfig, presets=PRESETS, build=GPT, flops_per_token=lambda c, t: 1e6,
                  lightning_module="toy_family.ToyModule", data_module="toy_family.ToyData", cli_modules=("toy_family",))
"""


@pytest.fixture
def toy_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed distribution's entry point ("lit_mesh.families": toy = "toy_family:TOY"), stood in for by
    monkeypatching importlib.metadata.entry_points as the registry calls it; the registry restored afterwards."""
    from importlib.metadata import EntryPoint

    from lit_mesh.planner import families

    (tmp_path / "toy_family.py").write_text(TOY_FAMILY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    toy = EntryPoint(name="toy", value="toy_family:TOY", group=families.GROUP)
    monkeypatch.setattr(families, "entry_points", lambda group: [toy] if group == families.GROUP else [])
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    monkeypatch.delitem(__import__("sys").modules, "toy_family", raising=False)
    return tmp_path


def test_a_family_installed_by_entry_point_is_planned_and_written(
    toy_entry_point: Path, capsys: pytest.CaptureFixture
) -> None:
    from lit_mesh.planner.cost import flops_per_token
    from lit_mesh.planner.families import family, family_names, family_of

    assert "toy" in family_names() and "toy_family" not in __import__("sys").modules  # listed without importing it
    toy = family("toy")
    config = toy.config("tiny")
    assert family_of(config) is toy and family_of(GPTConfig()) is family("gpt")  # the nearest config class wins
    assert flops_per_token(gpt_shapes(config), 64) == 1e6
    out = toy_entry_point / "toy.yaml"
    status, result, _ = _run(
        capsys,
        "--model",
        "toy",
        "--preset",
        "tiny",
        "--devices",
        "2",
        "--devices-per-node",
        "2",
        "--seq-len",
        "64",
        "--global-batch",
        "4",
        "--precision",
        "32-true",
        "--out",
        str(out),
    )
    assert status == 0 and result["ranked"]
    written = yaml_load(out)
    assert (
        written["model"]["class_path"] == "toy_family.ToyModule"
        and written["data"]["class_path"] == "toy_family.ToyData"
    )


def test_register_family_takes_the_same_family_again_and_refuses_another_under_its_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lit_mesh.planner import families
    from zoo.families import GPT_FAMILY

    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))
    assert families.register_family(GPT_FAMILY) is GPT_FAMILY
    other = dataclasses.replace(GPT_FAMILY, lightning_module="mine.GPTModule")
    with pytest.raises(ValueError, match="a model family named 'gpt' is registered already"):
        families.register_family(other)
    assert families.register_family(other, replace=True) is families.family("gpt") is other


def test_an_entry_point_that_names_no_family_is_refused(toy_entry_point: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lit_mesh.planner.families import family

    (toy_entry_point / "toy_family.py").write_text("TOY = 'not a family'\n")
    with pytest.raises(TypeError, match="must name a lit_mesh.planner.families.ModelFamily called 'toy'"):
        family("toy")


def yaml_load(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_a_newline_in_the_command_line_stays_in_the_header_comment(tmp_path: Path) -> None:
    import yaml

    from lit_mesh.planner.config_yaml import write_yaml

    argv = "lit-mesh plan --config-overrides '{\"a\": 1}\ninjected: true'"
    path = write_yaml(tmp_path / "fit.yaml", {"trainer": {"devices": 2}}, [argv, "best of 3"])
    assert yaml.safe_load(path.read_text()) == {"trainer": {"devices": 2}}
    assert "# injected: true" in path.read_text()


def test_routing_cv_example_of_the_planner_page(capsys: pytest.CaptureFixture) -> None:
    """docs/techniques/planner.md's --routing-cv command: it names the busiest ep rank's share, and the uneven
    router's plan is slower than the balanced one at the same degrees."""
    page = (Path(__file__).parents[2] / "docs" / "techniques" / "planner.md").read_text()
    argv = (
        "--model moe --preset qwen3-235b-a22b --devices 256 --global-batch 2048 --seq-len 4096 --tp 4 --pp 8 --ep 8"
    ).split()
    assert "lit-mesh plan " + " ".join(argv) + " --routing-cv 4.41" in page
    status, uneven, text = _run(capsys, *argv, "--routing-cv", "4.41", "--top", "1")
    assert status == 0 and "dropless routing (routing_cv 4.41): the busiest ep rank receives" in text
    status, balanced, text = _run(capsys, *argv, "--top", "1")
    assert status == 0 and "dropless routing" not in text
    assert uneven["ranked"][0]["tokens_per_s"] < 0.9 * balanced["ranked"][0]["tokens_per_s"]
