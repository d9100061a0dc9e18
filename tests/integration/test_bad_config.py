"""Bad configurations that only the running processes can see (the model's shapes, the data, a NaN loss), and
the `lit-mesh` command's exit: every rank stops with the message that names the value and the fix, never a hang."""

from __future__ import annotations

import json
import time

import pytest

from tests.launch import REPO, launch, run_command
from tests.worker_checks import selected_checks

S = "--trainer.strategy.init_args."


def _gpt(*extra: str) -> list[str]:
    return [
        "fit",
        "-c",
        str(REPO / "configs/gpt.yaml"),
        "--trainer.devices=2",
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        *extra,
    ]


MOE = ["fit", "-c", str(REPO / "configs/moe.yaml")]
# case: (the command line, what the message must say). Errors that need the processes (the model's shapes, the
# data): every rank stops with our message. One 2-rank launch runs the selected cases (tests/workers/expect_errors.py).
ERRORS_AFTER_START: dict[str, tuple[list[str], list[str]]] = {
    "tp_vs_kv_heads": (
        _gpt(f"{S}tp=2", "--model.init_args.config_overrides={n_kv_heads: 1}"),
        ["tp=2 does not divide n_kv_heads=1 of GPT (choose tp in [1])"],
    ),
    "tp_vs_ffn": (
        _gpt(f"{S}tp=2", "--model.init_args.config_overrides={ffn_hidden: 129}"),
        ["tp=2 does not divide ffn_hidden=129"],
    ),
    "sp_vs_seq_len": (
        _gpt(f"{S}tp=2", "--data.init_args.seq_len=63"),
        ["sequence length divisible by tp", "length 63, tp=2"],
    ),
    "batch_vs_dp": (
        _gpt(f"{S}dp=2", "--data.init_args.global_batch_size=3"),
        ["global_batch_size=3 is not divisible by the data-parallel size 2"],
    ),
    # pipeline: the model's blocks and the batch are known only once the processes run
    "pp_stages_vs_blocks": (
        _gpt(f"{S}pp=2", f"{S}pp_schedule=interleaved_1f1b"),
        ["4 pipeline stages but the model has 2 blocks", "choose pp x pp_stages_per_rank <= 2"],
    ),
    "pp_split_vs_blocks": (
        _gpt(f"{S}pp=2", f"{S}pp_split=[1, 2]"),
        ["pp_split=[1, 2] must give every stage >= 1 block and add up to the model's 2 blocks"],
    ),
    "pp_microbatches_vs_batch": (
        _gpt(f"{S}pp=2", f"{S}pp_microbatches=3"),
        ["pp_microbatches=3 does not divide the batch of 8 samples"],
    ),
    "2bw_with_tied_embeddings": (
        _gpt(f"{S}pp=2", f"{S}pp_schedule=2bw", "--model.init_args.config_overrides={tie_embeddings: true}"),
        ["pp_schedule='2bw' with GPT's tied parameters ['tok_embeddings.weight = output.weight']", "untie them"],
    ),
    "cp_vs_seq_len": (
        _gpt(f"{S}cp=2", "--data.init_args.seq_len=66"),
        ["sequence length is 66; use a sequence length that is a multiple of 4"],
    ),
    "ulysses_vs_heads": (
        _gpt(
            f"{S}cp=2",
            f"{S}cp_style=ulysses",
            "--model.init_args.config_overrides={dim: 96, n_heads: 3, n_kv_heads: 3}",
        ),
        ["3 query heads on this rank (after tp) are not divisible by cp=2"],
    ),
    "cp_without_attention": (
        [a.replace("gpt.yaml", "vit.yaml") for a in _gpt(f"{S}cp=2")],  # ViT: no attention in its plan
        ["declares no attention module (ContextPlan.attention)"],
    ),
    "cp_self_parallelised": (
        _gpt(f"{S}cp=2", "--model=tests.workers.cp_modules.SelfShardedGPT"),
        ["cp=2 but configure_model of SelfShardedGPT parallelised the model itself"],
    ),
    # a NaN on one rank stops every rank together, naming the step and the rank
    "nan_loss": (
        _gpt(
            f"{S}dp=2",
            "--trainer.max_steps=6",
            "--trainer.callbacks=lit_mesh.FaultInjector",
            "--trainer.callbacks.fault=nan_loss",
            "--trainer.callbacks.step=3",
            "--trainer.callbacks.rank=1",
        ),
        ["FloatingPointError: ", "non-finite training loss at step 3 on rank(s) [1]"],
    ),
    "ep_vs_experts": (
        [*MOE, *_gpt(f"{S}ep=2")[3:], "--model.init_args.config_overrides={n_experts: 3}"],
        ["ep=2 does not divide n_experts=3 of MoETransformer (choose ep in [1, 3])"],
    ),
    "ep_dense_model": (_gpt(f"{S}ep=2"), ["ep=2 but GPT.parallel_plan() declares no MoE layer"]),
    "experts_vs_shards": (
        [*MOE, *_gpt(f"{S}dp=2")[3:], "--model.init_args.config_overrides={expert_hidden: 63}"],
        ["is FSDP-sharded by its dim 1 (63) over dp_shard x cp / ep = 2 x 1 / 1 = 2 ranks"],
    ),
}


@pytest.fixture(scope="module")
def errors_after_start(request: pytest.FixtureRequest) -> dict[str, dict[str, str]]:
    """{case: {"type", "message"}} of the selected cases, from one 2-rank launch."""
    out = request.getfixturevalue("tmp_path_factory").mktemp("errors_after_start")
    spec = out / "cases.json"
    spec.write_text(json.dumps({case: ERRORS_AFTER_START[case][0] for case in selected_checks(request)}))
    proc = launch(2, "expect_errors.py", str(out / "errors.json"), str(spec), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "errors.json").read_text())


@pytest.mark.parametrize("check", list(ERRORS_AFTER_START))
def test_errors_after_start_are_clear(errors_after_start: dict[str, dict[str, str]], check: str) -> None:
    error = errors_after_start[check]
    said = f"{error['type']}: {error['message']}"
    for expected in ERRORS_AFTER_START[check][1]:
        assert expected in said, said


def test_console_script_exits_with_the_message_instead_of_hanging() -> None:
    start = time.monotonic()
    proc = run_command(
        ["lit-mesh", *_gpt(f"{S}tp=2", "--model.init_args.config_overrides={dim: 96, n_heads: 3, n_kv_heads: 3}")], 180
    )
    assert proc.returncode != 0
    assert "tp=2 does not divide n_heads=3 of GPT (choose tp in [1, 3])" in proc.stderr
    assert time.monotonic() - start < 180


def test_unknown_preset_is_named() -> None:
    proc = run_command(["lit-mesh", *_gpt("--model.init_args.preset=huge", "--trainer.devices=1")], 120)
    assert proc.returncode != 0 and "huge" in proc.stderr
