"""benchmarks/gpu.py runs (a tiny CPU smoke of the one-GPU comparison) and prints its JSON result line."""

from __future__ import annotations

import json
import sys

import pytest

from tests.launch import REPO, run_command


def test_gpu_benchmark_smoke_prints_tokens_per_s_mfu_and_the_ratio() -> None:
    args = [
        "--preset",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--compile-backend",
        "none",
        "--peak-flops",
        "1e9",
    ]
    proc = run_command([sys.executable, str(REPO / "benchmarks/gpu.py"), *args], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["card"] == "cpu" and result["config"]["preset"] == "tiny"
    assert (result["config"]["params"], result["config"]["tie_embeddings"]) == (106_816, False)
    tokens = 2 * 2 * 16  # steps x batch x seq_len
    for run in result["rounds"]:
        assert run["tokens_per_s"] == pytest.approx(tokens / run["seconds"])
        assert run["mfu"] == pytest.approx(run["tokens_per_s"] * result["flops_per_token"] / 1e9)
    assert {r["run"] for r in result["rounds"]} == {"lit_mesh", "hand_loop"}
    ratio = result["tokens_per_s"]["lit_mesh"] / result["tokens_per_s"]["hand_loop"]
    assert result["ratio_lit_mesh_over_hand_loop"] == pytest.approx(ratio)
    assert result["peak_memory_gib"] == {"lit_mesh": None, "hand_loop": None}  # no CUDA allocator on CPU


def test_gpu_recipe_is_bf16_mixed_compiled_1b_with_the_monitor() -> None:
    proc = run_command(
        [sys.executable, "-m", "lit_mesh.cli", "fit", "-c", str(REPO / "configs/gpu.yaml"), "--print_config"], 120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import yaml

    config = yaml.safe_load(proc.stdout)
    trainer = config["trainer"]
    assert (trainer["accelerator"], trainer["precision"]) == ("gpu", "bf16-mixed")
    assert trainer["strategy"]["init_args"]["compile_blocks"] is True
    callbacks = [c["class_path"] for c in trainer["callbacks"]]
    assert {
        "lit_mesh.MeshMonitor",
        "lit_mesh.GradientNormMonitor",
        "lightning.pytorch.callbacks.LearningRateMonitor",
    } <= set(callbacks)
    assert config["model"]["init_args"]["preset"] == "llama3.2-1b"


def test_llama32_1b_preset_has_the_published_shape() -> None:
    from zoo.gpt import GPTConfig

    c = GPTConfig.from_preset("llama3.2-1b")
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_hidden, c.vocab_size) == (2048, 16, 32, 8, 8192, 128256)
    assert c.tie_embeddings  # as Meta's Llama 3.2 1B: the head is the embedding matrix
