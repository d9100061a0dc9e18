"""Layout parity through the `lit-mesh` CLI: every mesh layout trains the same model on the same global
batches and must match the single-device run step by step (fp32: relative 1e-4 per step over 10 steps)
and in the final full parameters (1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import REPO, cli_runs
from tests.token_corpus import VOCAB, prepare_shards, train_tokenizer

STEPS = 10
# exactly the overrides a user types (issue #2), plus quiet output
COMMON = [
    f"--trainer.max_steps={STEPS}",
    "--trainer.log_every_n_steps=1",
    "--trainer.logger=CSVLogger",
    "--data.global_batch_size=8",
    "--seed_everything=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
]
S = "--trainer.strategy.init_args."
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "plain": (1, ["--trainer.strategy=auto"]),  # no MeshStrategy at all
    "single": (1, []),  # MeshStrategy() on one device
    "ddp2": (2, [f"{S}dp_replicate=2"]),
    "fsdp2": (2, [f"{S}dp=2"]),
    "tp2": (2, [f"{S}tp=2"]),
    "tp2_no_sp": (2, [f"{S}tp=2", f"{S}sequence_parallel=false"]),
    "fsdp4": (4, [f"{S}dp=4"]),
    "hsdp2x2": (4, [f"{S}dp_replicate=2", f"{S}dp_shard=2"]),
    "fsdp2_tp2": (4, [f"{S}tp=2"]),  # dp_shard fills the rest: 2
}
RECIPES = {"gpt": "configs/gpt.yaml", "vit": "configs/vit.yaml"}
# the GPT recipe on token shards (zoo.TokenDataModule, a BPE of 384 tokens): the same promise on real data
TOKEN_LAYOUTS = {"single": (1, []), "fsdp2": LAYOUTS["fsdp2"], "tp2": LAYOUTS["tp2"], "pp2": (2, [f"{S}pp=2"])}
TIED = "--model.init_args.config_overrides={tie_embeddings: true}"
WIDE_HEADS = "--model.init_args.config_overrides={head_dim: 32}"  # the tiny preset's 4 heads of 16 made 32 wide
# more GPT runs in the same launches: gradient accumulation (parity) and bf16 (runs, sane, right dtypes)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "single-accum2": ("single", ["--trainer.accumulate_grad_batches=2"]),
    "fsdp2_tp2-accum2": ("fsdp2_tp2", ["--trainer.accumulate_grad_batches=2"]),
    "fsdp2_tp2-bf16-mixed": ("fsdp2_tp2", ["--trainer.precision=bf16-mixed"]),
    "fsdp2_tp2-bf16-true": ("fsdp2_tp2", ["--trainer.precision=bf16-true"]),
    "tp2-bf16-mixed": ("tp2", ["--trainer.precision=bf16-mixed"]),
    "fsdp2_tp2-fp16-mixed": ("fsdp2_tp2", ["--trainer.plugins=lit_mesh.FP16MixedPrecision"]),
    "fsdp2_tp2-ac-full": ("fsdp2_tp2", [f"{S}activation_checkpointing=full"]),
    # full AC on block 1, selective on block 0 (ac_other_blocks)
    "fsdp2_tp2-ac-full2-selective": (
        "fsdp2_tp2",
        [f"{S}activation_checkpointing=full", f"{S}ac_every_n_blocks=2", f"{S}ac_other_blocks=selective"],
    ),
    "fsdp2_tp2-ac-selective-every2": (
        "fsdp2_tp2",
        [f"{S}activation_checkpointing=selective", f"{S}ac_every_n_blocks=2"],
    ),
    "fsdp2-compile": ("fsdp2", [f"{S}compile_blocks=true", f"{S}compile_backend=aot_eager"]),
    "fsdp2_tp2-compile": ("fsdp2_tp2", [f"{S}compile_blocks=true", f"{S}compile_backend=aot_eager"]),
    # ZeRO stages 1 and 2 (stage 1 with accumulation: gradients then reduced once per step)
    "fsdp2-zero1-accum2": ("fsdp2", [f"{S}zero_stage=1", "--trainer.accumulate_grad_batches=2"]),
    "fsdp2-zero2": ("fsdp2", [f"{S}zero_stage=2"]),
    "fsdp2_tp2-zero2": ("fsdp2_tp2", [f"{S}zero_stage=2"]),
    "fsdp2_tp2-bf16-mixed-ac-selective": (
        "fsdp2_tp2",
        ["--trainer.precision=bf16-mixed", f"{S}activation_checkpointing=selective"],
    ),
    # tp_mode=2d: SUMMA on a 2 x 2 grid of the 4 ranks, no dp (fsdp4's dp=4 overridden)
    "tp4-2d": ("fsdp4", [f"{S}dp=1", f"{S}tp=4", f"{S}tp_mode=2d", f"{S}sequence_parallel=false"]),
    # tied input/output embeddings (zoo GPT tie_embeddings): one matrix, TP shards both uses over the vocabulary
    **{f"{layout}-tied": (layout, [TIED]) for layout in ("single", "fsdp2", "tp2", "fsdp2_tp2")},
    # pp=2 (tp2's two ranks, tp overridden): the first and the last stage each hold a copy of the tied matrix
    "pp2-tied": ("tp2", [f"{S}tp=1", f"{S}pp=2", TIED]),
    # heads wider than dim / n_heads (Qwen3, Mistral-Nemo): wq and wo are not square, tp splits their heads
    **{f"{layout}-wide-heads": (layout, [WIDE_HEADS]) for layout in ("single", "fsdp2_tp2")},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every (recipe, layout) run, grouped into one torchrun launch per world size."""
    out = tmp_path_factory.mktemp("parity")
    shards = prepare_shards(train_tokenizer(out / "tokenizer"), out / "shards")
    token_data = [
        "--data=zoo.TokenDataModule",
        f"--data.path={shards}",
        "--data.seq_len=64",
        f"--model.init_args.config_overrides={{vocab_size: {VOCAB}}}",
    ]
    found: dict[str, dict] = {}
    for nproc in (1, 2, 4):
        runs = [
            {"name": f"{recipe}-{layout}", "args": ["-c", str(REPO / cfg), f"--trainer.devices={n}", *COMMON, *extra]}
            for recipe, cfg in RECIPES.items()
            for layout, (n, extra) in LAYOUTS.items()
            if n == nproc
        ]
        runs += [
            {
                "name": f"gpt-{variant}",
                "args": [
                    "-c",
                    str(REPO / RECIPES["gpt"]),
                    f"--trainer.devices={nproc}",
                    *COMMON,
                    *LAYOUTS[layout][1],
                    *extra,
                ],
            }
            for variant, (layout, extra) in VARIANTS.items()
            if LAYOUTS[layout][0] == nproc
        ]
        runs += [
            {
                "name": f"token-{layout}",
                "args": ["-c", str(REPO / RECIPES["gpt"]), f"--trainer.devices={n}", *COMMON, *extra, *token_data],
            }
            for layout, (n, extra) in TOKEN_LAYOUTS.items()
            if n == nproc
        ]
        found.update(cli_runs(nproc, out, runs))
    found["_dir"] = {"path": str(out)}
    return found


def losses(result: dict) -> list[float]:
    per_step = result["metrics"]["train_loss"]
    return [per_step[s] for s in sorted(per_step, key=int)]


def _assert_same_curve(reference: list[float], got: list[float], what: str) -> None:
    assert len(reference) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(reference, got), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: {what} loss {b} vs single-device {a}"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_mesh_strategy_on_one_device_equals_no_strategy(results: dict, recipe: str) -> None:
    assert losses(results[f"{recipe}-single"]) == losses(results[f"{recipe}-plain"])  # bit-identical


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("plain", "single")])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_layout_matches_single_device(results: dict, recipe: str, layout: str) -> None:
    reference, candidate = results[f"{recipe}-single"], results[f"{recipe}-{layout}"]
    assert candidate["world_size"] == LAYOUTS[layout][0]
    ref_losses = losses(reference)
    assert len(set(ref_losses)) == STEPS, "the reference run must actually update the model"
    _assert_same_curve(ref_losses, losses(candidate), layout)

    out = Path(results["_dir"]["path"])
    ref_params = torch.load(out / f"{recipe}-single" / "params.pt", weights_only=True)
    params = torch.load(out / f"{recipe}-{layout}" / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys()
    for name, ref in ref_params.items():
        diff = (params[name].float() - ref.float()).abs().max().item()
        assert diff <= 1e-4, f"{layout}: parameter {name} differs by {diff}"


def test_grid_tp_mode_matches_single_device(results: dict) -> None:
    """MeshStrategy(tp=4, tp_mode="2d") from the CLI: meta-device build, the grid plan, Lightning's clipping by the
    global norm and AdamW on the grid's DTensors follow the single-device curve and end on its parameters."""
    reference, candidate = results["gpt-single"], results["gpt-tp4-2d"]
    assert candidate["world_size"] == 4
    _assert_same_curve(losses(reference), losses(candidate), "tp4-2d")
    out = Path(results["_dir"]["path"])
    ref_params = torch.load(out / "gpt-single" / "params.pt", weights_only=True)
    params = torch.load(out / "gpt-tp4-2d" / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys()
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 1e-4, f"tp4-2d: parameter {name}"
    norms = [candidate["metrics"]["grad_norm"][s] for s in sorted(candidate["metrics"]["grad_norm"], key=int)]
    ref_norms = [reference["metrics"]["grad_norm"][s] for s in sorted(reference["metrics"]["grad_norm"], key=int)]
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("plain", "single")])
def test_gradient_norm_and_learning_rate_are_logged_as_on_one_device(results: dict, layout: str) -> None:
    """The recipes' GradientNormMonitor: the norm of the whole gradient, whatever shards it (log_every_n_steps=1)."""
    reference, candidate = results["gpt-single"]["metrics"], results[f"gpt-{layout}"]["metrics"]
    for key in ("grad_norm", "lr-AdamW"):
        ref = [reference[key][s] for s in sorted(reference[key], key=int)]
        got = [candidate[key][s] for s in sorted(candidate[key], key=int)]
        assert len(ref) == len(got) == STEPS, (key, ref, got)
        for step, (a, b) in enumerate(zip(ref, got), start=1):  # 1e-3: a norm amplifies the losses' last bits
            assert abs(a - b) <= 1e-3 * abs(a), f"step {step}: {layout} {key} {b} vs single-device {a}"
    assert len(set(reference["grad_norm"].values())) == STEPS


@pytest.mark.parametrize("layout", [name for name in TOKEN_LAYOUTS if name != "single"])
def test_token_data_layout_matches_single_device(results: dict, layout: str) -> None:
    reference = losses(results["token-single"])
    assert len(set(reference)) == STEPS and reference[0] > 5.0, "a BPE vocabulary of 384: ln(384) = 5.95 at the start"
    _assert_same_curve(reference, losses(results[f"token-{layout}"]), f"token data {layout}")


def test_gradient_accumulation_matches_single_device(results: dict) -> None:
    _assert_same_curve(losses(results["gpt-single-accum2"]), losses(results["gpt-fsdp2_tp2-accum2"]), "accum2")
    assert losses(results["gpt-single-accum2"]) != losses(results["gpt-single"])


@pytest.mark.parametrize(
    ("variant", "param_dtype"),
    [
        ("fsdp2_tp2-bf16-mixed", torch.float32),
        ("fsdp2_tp2-bf16-true", torch.bfloat16),
        ("tp2-bf16-mixed", torch.float32),
        ("fsdp2_tp2-fp16-mixed", torch.float32),
    ],
)
def test_half_precision_trains_near_fp32(results: dict, variant: str, param_dtype: torch.dtype) -> None:
    fp32, bf16 = losses(results["gpt-single"]), losses(results[f"gpt-{variant}"])
    assert len(bf16) == STEPS
    # bf16/fp16 rounding moves the curve a little, never far: within 2% at every step
    for a, b in zip(fp32, bf16):
        assert abs(a - b) <= 0.02 * a, (variant, fp32, bf16)
    assert bf16 != fp32, "half precision must actually compute in half precision"
    params = torch.load(Path(results["_dir"]["path"]) / f"gpt-{variant}" / "params.pt", weights_only=True)
    assert {t.dtype for t in params.values()} == {param_dtype}  # bf16-mixed keeps fp32 master weights


@pytest.mark.parametrize(
    "variant", ["fsdp2_tp2-ac-full", "fsdp2_tp2-ac-selective-every2", "fsdp2_tp2-ac-full2-selective"]
)
def test_activation_checkpointing_keeps_the_loss_curve(results: dict, variant: str) -> None:
    _assert_same_curve(losses(results["gpt-single"]), losses(results[f"gpt-{variant}"]), variant)
    # recomputation changes no number: the same as without checkpointing on the same mesh
    assert losses(results[f"gpt-{variant}"]) == losses(results["gpt-fsdp2_tp2"])


def test_selective_checkpointing_under_bf16_mixed_changes_no_number(results: dict) -> None:
    # FSDP2 casts block inputs to bf16 in a hook that recompute runs inside the checkpointed region
    assert losses(results["gpt-fsdp2_tp2-bf16-mixed-ac-selective"]) == losses(results["gpt-fsdp2_tp2-bf16-mixed"])


@pytest.mark.parametrize(
    ("variant", "reference"),
    [
        ("fsdp2-zero1-accum2", "single-accum2"),
        ("fsdp2-zero2", "single"),
        ("fsdp2_tp2-zero2", "single"),
    ],
)
def test_zero_stages_keep_the_loss_curve(results: dict, variant: str, reference: str) -> None:
    _assert_same_curve(losses(results[f"gpt-{reference}"]), losses(results[f"gpt-{variant}"]), variant)
    out = Path(results["_dir"]["path"])
    ref_params = torch.load(out / f"gpt-{reference}" / "params.pt", weights_only=True)
    params = torch.load(out / f"gpt-{variant}" / "params.pt", weights_only=True)
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 1e-4, f"{variant}: parameter {name}"


@pytest.mark.parametrize("variant", ["fsdp2-compile", "fsdp2_tp2-compile"])
def test_compiled_blocks_keep_the_loss_curve(results: dict, variant: str) -> None:
    # aot_eager: dynamo + AOTAutograd over FSDP2 (x TP) blocks, without inductor's code generation time (minutes
    # on 2 CPU cores); inductor with tp: `python benchmarks/compile_tp_repro.py --backend inductor` (gradients vs one
    # device)
    _assert_same_curve(losses(results["gpt-single"]), losses(results[f"gpt-{variant}"]), variant)


def test_heads_wider_than_dim_over_heads_keep_the_loss_curve(results: dict) -> None:
    reference = losses(results["gpt-single-wide-heads"])
    assert reference != losses(results["gpt-single"]), "wider heads must change the model"
    _assert_same_curve(reference, losses(results["gpt-fsdp2_tp2-wide-heads"]), "wide heads fsdp2_tp2")
    out = Path(results["_dir"]["path"])
    ref_params = torch.load(out / "gpt-single-wide-heads" / "params.pt", weights_only=True)
    params = torch.load(out / "gpt-fsdp2_tp2-wide-heads" / "params.pt", weights_only=True)
    assert params["model.layers.0.attention.wq.weight"].shape == (4 * 32, 64)
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 1e-4, f"wide heads: parameter {name}"


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "fsdp2_tp2", "pp2"])
def test_tied_embeddings_keep_the_loss_curve_and_stay_one_matrix(results: dict, layout: str) -> None:
    reference = losses(results["gpt-single-tied"])
    assert reference != losses(results["gpt-single"]), "tying must change the model"
    _assert_same_curve(reference, losses(results[f"gpt-{layout}-tied"]), f"tied {layout}")
    out = Path(results["_dir"]["path"])
    ref_params = torch.load(out / "gpt-single-tied" / "params.pt", weights_only=True)
    params = torch.load(out / f"gpt-{layout}-tied" / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys()
    # 2e-4, not 1e-4: the gradients agree as closely as untied ones (relative 5e-7 at step 1, fsdp2), but the
    # summed gradient of the shared matrix moves AdamW's small-gradient entries more over 10 steps (measured: max
    # 9.6e-5 on fsdp2 x tp2, in attention.wo; untied 1.1e-5); the loss curve above keeps the 1e-4 promise
    for name, ref in ref_params.items():
        assert (params[name] - ref).abs().max().item() <= 2e-4, f"tied {layout}: parameter {name}"
    # trained as one matrix: the head equals the embedding after 10 steps (two copies would have drifted apart)
    assert torch.equal(params["model.output.weight"], params["model.tok_embeddings.weight"])
    if layout == "pp2":  # the norm counts the matrix once, though both stages hold a copy
        norms = [results[f"gpt-{v}-tied"]["metrics"]["grad_norm"] for v in ("single", layout)]
        ref_norms, got_norms = ([n[s] for s in sorted(n, key=int)] for n in norms)
        assert all(abs(a - b) <= 1e-3 * a for a, b in zip(ref_norms, got_norms)), (ref_norms, got_norms)
