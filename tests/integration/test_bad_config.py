"""Bad configurations that only the running processes can see (the model's shapes, the data, a NaN loss), and
the `lit-mesh` command's exit: every rank stops with the message that names the value and the fix, never a hang."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.launch import REPO, run_command, torchrun

S = "--trainer.strategy.init_args."


def _gpt(*extra: str) -> list[str]:
    return [
        "fit", "-c", str(REPO / "configs/gpt.yaml"), "--trainer.devices=2", "--trainer.max_steps=2",
        "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
        *extra,
    ]  # fmt: skip


def test_errors_after_start_are_clear(tmp_path: Path) -> None:
    """Errors that need the processes (the model's shapes, the data): every rank stops with our message."""
    cases = {
        "tp_vs_kv_heads": _gpt(f"{S}tp=2", "--model.init_args.config_overrides={n_kv_heads: 1}"),
        "tp_vs_ffn": _gpt(f"{S}tp=2", "--model.init_args.config_overrides={ffn_hidden: 129}"),
        "sp_vs_seq_len": _gpt(f"{S}tp=2", "--data.init_args.seq_len=63"),
        "batch_vs_dp": _gpt(f"{S}dp=2", "--data.init_args.global_batch_size=3"),
        # pipeline: the model's blocks and the batch are known only once the processes run
        "pp_stages_vs_blocks": _gpt(f"{S}pp=2", f"{S}pp_schedule=interleaved_1f1b"),
        "pp_split_vs_blocks": _gpt(f"{S}pp=2", f"{S}pp_split=[1, 2]"),
        "pp_microbatches_vs_batch": _gpt(f"{S}pp=2", f"{S}pp_microbatches=3"),
        "cp_vs_seq_len": _gpt(f"{S}cp=2", "--data.init_args.seq_len=66"),
        "ulysses_vs_heads": _gpt(f"{S}cp=2", f"{S}cp_style=ulysses", "--model.init_args.config_overrides={dim: 96, n_heads: 3, n_kv_heads: 3}"),
        "cp_without_attention": [a.replace("gpt.yaml", "vit.yaml") for a in _gpt(f"{S}cp=2")],  # ViT: no attention in its plan
        "cp_self_parallelised": _gpt(f"{S}cp=2", "--model=tests.workers.cp_modules.SelfShardedGPT"),
        "nan_loss": _gpt(
            f"{S}dp=2", "--trainer.max_steps=6", "--model=tests.workers.faulty_modules.NaNLossAt",
            "--model.init_args.step=3", "--model.init_args.rank=1",
        ),
        "ep_vs_experts": [
            "fit", "-c", str(REPO / "configs/moe.yaml"), *_gpt(f"{S}ep=2")[3:],
            "--model.init_args.config_overrides={n_experts: 3}",
        ],
        "ep_dense_model": _gpt(f"{S}ep=2"),
        "pp_moe": ["fit", "-c", str(REPO / "configs/moe.yaml"), *_gpt(f"{S}pp=2")[3:]],
        "experts_vs_shards": [
            "fit", "-c", str(REPO / "configs/moe.yaml"), *_gpt(f"{S}dp=2")[3:],
            "--model.init_args.config_overrides={expert_hidden: 63}",
        ],
    }
    spec, out = tmp_path / "cases.json", tmp_path / "errors.json"
    spec.write_text(json.dumps(cases))
    proc = torchrun(2, "expect_errors.py", str(out), str(spec), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    errors = json.loads(out.read_text())
    assert "tp=2 does not divide n_kv_heads=1 of GPT (choose tp in [1])" in errors["tp_vs_kv_heads"]["message"]
    assert "tp=2 does not divide ffn_hidden=129" in errors["tp_vs_ffn"]["message"]
    assert "sequence length divisible by tp" in errors["sp_vs_seq_len"]["message"]
    assert "length 63, tp=2" in errors["sp_vs_seq_len"]["message"]
    assert "global_batch_size=3 is not divisible by the data-parallel size 2" in errors["batch_vs_dp"]["message"]
    assert "4 pipeline stages but the model has 2 blocks" in errors["pp_stages_vs_blocks"]["message"]
    assert "choose pp x pp_stages_per_rank <= 2" in errors["pp_stages_vs_blocks"]["message"]
    assert "pp_split=[1, 2] must give every stage >= 1 block and add up to the model's 2 blocks" in errors[
        "pp_split_vs_blocks"]["message"]
    assert "pp_microbatches=3 does not divide the batch of 8 samples" in errors["pp_microbatches_vs_batch"]["message"]
    assert "sequence length is 66; use a sequence length that is a multiple of 4" in errors["cp_vs_seq_len"]["message"]
    assert "3 query heads on this rank (after tp) are not divisible by cp=2" in errors["ulysses_vs_heads"]["message"]
    assert "declares no attention module (ParallelPlan.attention)" in errors["cp_without_attention"]["message"]
    assert "cp=2 but configure_model of SelfShardedGPT parallelised the model itself" in errors["cp_self_parallelised"]["message"]
    # a NaN on one rank stops every rank together, naming the step and the rank
    assert errors["nan_loss"]["type"] == "FloatingPointError"
    assert "non-finite training loss at step 3 on rank(s) [1]" in errors["nan_loss"]["message"]
    assert "ep=2 does not divide n_experts=3 of MoETransformer (choose ep in [1, 3])" in errors["ep_vs_experts"]["message"]
    assert "ep=2 but GPT.parallel_plan() declares no MoE layer" in errors["ep_dense_model"]["message"]
    assert "pp=2 with the MoE model MoETransformer: pipeline stages do not carry" in errors["pp_moe"]["message"]
    assert "is FSDP-sharded by its dim 1 (63) over dp_shard x cp / ep = 2 x 1 / 1 = 2 ranks" in errors[
        "experts_vs_shards"]["message"]


def test_console_script_exits_with_the_message_instead_of_hanging() -> None:
    start = time.monotonic()
    proc = run_command(["lit-mesh", *_gpt(f"{S}tp=2", "--model.init_args.config_overrides={dim: 96, n_heads: 3, n_kv_heads: 3}")], 180)
    assert proc.returncode != 0
    assert "tp=2 does not divide n_heads=3 of GPT (choose tp in [1, 3])" in proc.stderr
    assert time.monotonic() - start < 180


def test_unknown_preset_is_named() -> None:
    proc = run_command(["lit-mesh", *_gpt("--model.init_args.preset=huge", "--trainer.devices=1")], 120)
    assert proc.returncode != 0 and "huge" in proc.stderr
