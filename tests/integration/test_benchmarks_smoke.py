"""Every benchmark script still runs: each benchmarks/*.py at its smallest setting prints, as its last stdout line,
one JSON object with the keys its result promises (the keys benchmarks/report/*.md reads from results/*.json).

Cheap by construction: one interpreter imports torch, Lightning, lit-mesh and the zoo once and forks every script
from it, and the scripts' ranks are forked too (tests/workers/benchmark_smoke.py); the sizes are the smallest that
still run each script's code paths (tiny presets, 1-2 steps, 1-2 ranks). Every output goes to a temporary
directory: the committed results, figures and README under benchmarks/ are checked unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, WORKERS, run_command

BENCHMARKS = REPO / "benchmarks"
TIMING = ["--preset", "tiny", "--batch-size", "1", "--seq-len", "16", "--steps", "1", "--warmup", "1", "--repeats", "1"]
STEP_TIMING_KEYS = {"benchmark", "ratio", "goal", "goal_met", "config"}
# name -> (script, its arguments ({tmp}: this run's temporary directory), the keys its JSON line must hold)
CASES: dict[str, tuple[str, list[str], set[str]]] = {
    "compile_tp_repro": (
        "compile_tp_repro.py",
        ["--backend", "eager", "--cases", "eager-sp", "--port", "0"],
        {"torch", "backend", "cases"},
    ),
    "compression": (
        "compression.py",
        ["--modes", "fp32,onebit", "--preset", "tiny", "--steps", "2", "--global-batch-size", "2", "--seq-len", "16"],
        {"benchmark", "layout", "table", "goals", "goal_met", "plot"},
    ),
    "context_parallel": (
        "context_parallel.py",
        ["--cp", "1", "2", "--seq-len", "64", "--budget-mib", "0"],
        {"benchmark", "peak_activation_memory", "bytes_sent_per_step", "budget", "goal_met", "config"},
    ),
    "gpu": (
        "gpu.py",
        [
            "--preset",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--compile-backend",
            "none",
            "--peak-flops",
            "1e9",
        ],
        {
            "benchmark",
            "card",
            "flops_per_token",
            "tokens_per_s",
            "ratio_lit_mesh_over_hand_loop",
            "mfu",
            "peak_memory_gib",
            "rounds",
            "goals",
            "config",
        },
    ),
    "hf": (
        "hf.py",
        ["--dp", "1", "--tp", "2", *TIMING],
        {*STEP_TIMING_KEYS, "median_step_s_transformers_llama", "median_step_s_zoo_gpt", "ratio_per_repeat"},
    ),
    "host_sync": (
        "host_sync.py",
        ["--layouts", "fsdp2"],
        {"benchmark", "audited_step", "log_every_n_steps", "layouts", "goal", "goal_met", "config"},
    ),
    "loss_curves": (
        "loss_curves.py",
        ["--layouts", "single", "--steps", "2", "--png", "{tmp}/loss_curves.png"],
        {"benchmark", "png", "losses", "max_relative_gap", "goal", "goal_met", "config"},
    ),
    "memory": (
        "memory.py",
        [
            "--preset",
            "tiny",
            "--fsdp",
            "1",
            "2",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--fake-preset",
            "none",
            "--ac-mesh",
            "none",
            "--budget-gib",
            "0",
        ],
        {"benchmark", "single_device_bytes", "expected_single_device_bytes", "fsdp", "max_ratio", "goal_met", "config"},
    ),
    "memory_loss": (
        "memory.py",
        ["--loss-only", "--loss-vocab", "256", "--loss-tokens", "64", "--loss-chunks", "2"],
        {"benchmark", "loss_device", "tokens", "vocab", "chunks", "by_dtype", "goal", "goal_met"},
    ),
    "memory_zero": (
        "memory.py",
        ["--zero", "--preset", "tiny", "--fsdp", "2", "--batch-size", "1", "--seq-len", "16"],
        {"benchmark", "global_numel", "formulas", "runs", "max_ratio", "goal", "goal_met", "config"},
    ),
    "moe": (
        "moe.py",
        [
            "--eps",
            "2",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--balance-steps",
            "2",
            "--balance-batch",
            "2",
            "--balance-seq-len",
            "16",
        ],
        {
            "benchmark",
            "preset",
            "throughput",
            "a2a_goal_met",
            "throughput_config",
            "balance",
            "balance_config",
            "balance_goal_met",
            "environment",
        },
    ),
    "overhead": (
        "overhead.py",
        ["--dp", "1", "--tp", "2", *TIMING],
        {*STEP_TIMING_KEYS, "median_step_s_mesh", "median_step_s_plain", "ratio_per_repeat"},
    ),
    "pipeline": (
        "pipeline.py",
        [
            "--pp",
            "2",
            "--microbatches",
            "2",
            "--schedules",
            "1f1b",
            "--preset",
            "tiny",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
        ],
        {"benchmark", "schedules", "config"},
    ),
    "planner": (
        "planner.py",
        ["--presets", "small", "--devices", "8", "--moe-presets", "--global-batch", "8", "--seq-len", "256"],
        {"benchmark", "rows", "max_plan_seconds", "all_simulations_equal", "goal", "goal_met", "config"},
    ),
    "pretrained_load": (
        "pretrained_load.py",
        ["--ranks", "2", "--tp", "1", "--hidden", "192", "--layers", "1", "--vocab", "256"],
        {"config", "whole_model_mib", "largest_tensor_mib", "per_rank", "goal_met_reading", "goal_met_whole_setup"},
    ),
    "tensorboard_scalars": ("tensorboard_scalars.py", ["{tmp}/tensorboard"], {"benchmark", "log_dir", "scalars"}),
    "token_loader": (
        "token_loader.py",
        [
            "--max-files",
            "3",
            "--vocab",
            "300",
            "--workers",
            "1",
            "--seq-len",
            "32",
            "--global-batch-size",
            "2",
            "--max-batches",
            "3",
            "--matmul-size",
            "128",
        ],
        {"config", "prepare", "loader", "one_b", "loader_over_cpu_step", "goal_20x_met_cpu"},
    ),
    "topology": (
        "topology.py",
        ["--simulate", "2x2", "--mib", "0.01", "--presets", "small"],
        {"measured", "predicted_gradient_all_reduce_per_step", "environment"},
    ),
    "own_model_memory": (
        "own_model_memory.py",
        ["--dim", "32"],
        {"benchmark", "config", "fraction_of_full", "goal_fraction", "per_block_meets_goal", "cpu_offload"},
    ),
    "startup": (
        "startup.py",
        ["--preset", "small", "--world", "2"],
        {"benchmark", "preset", "world", "rank", "parameters", "local_parameters", "seconds", "cpu_seconds"},
    ),
    "recipe_host_profile": (
        "recipe_host_profile.py",
        ["--steps", "2", "--warmup", "1", "--batch-size", "2", "--seq-len", "16", "--max-bytes", "20000"],
        {"benchmark", "recipe", "between_logging_steps", "logging_steps", "wall_s", "environment"},
    ),
    "tp_bytes": (
        "tp_bytes.py",
        ["--preset", "small"],
        {"preset", "tokens", "element_bytes", "schemes", "rows", "crossover", "measured", "environment"},
    ),
    "vs_modelparallel": (
        "vs_modelparallel.py",
        ["--dp", "1", "--tp", "2", *TIMING],
        {*STEP_TIMING_KEYS, "mesh_tokens_per_s", "modelparallel_tokens_per_s", "median_step_s"},
    ),
}
# the scripts that are not run here, and why (printed as the skip reason)
NOT_RUN = {
    "report.py": "not a benchmark: it renders benchmarks/README.md from the results (tests/unit/test_report.py)",
    "memory_zero.py": "a part of memory.py, run here as `memory.py --zero` (case memory_zero)",
}
TIMEOUT = 300  # ~70 s on a loaded 2-core machine: only a hang gets near it


def _committed_files() -> dict[str, str]:
    """Every file under benchmarks/ (results, figures, README, templates) by its content's hash."""
    files = (p for p in BENCHMARKS.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return {str(p.relative_to(REPO)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _tensorboard_events(directory: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory / "version_0"))
    writer.add_scalar("monitor/mfu", 0.5, 9)
    writer.close()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run every case in one runner; its directory holds NAME.stdout, NAME.stderr and NAME.json per case."""
    tmp = tmp_path_factory.mktemp("benchmarks_smoke")
    out = tmp / "out"
    out.mkdir()
    _tensorboard_events(tmp / "tensorboard")
    spec = [
        {"name": name, "script": str(BENCHMARKS / script), "argv": [a.replace("{tmp}", str(tmp)) for a in argv]}
        for name, (script, argv, _) in CASES.items()
    ]
    (tmp / "spec.json").write_text(json.dumps(spec))
    before = _committed_files()
    proc = run_command([sys.executable, str(WORKERS / "benchmark_smoke.py"), str(out), str(tmp / "spec.json")], TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _committed_files() == before, "a smoke run wrote under benchmarks/"
    return out


def test_every_benchmark_script_is_run_or_named_apart() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"_common.py"}
    assert scripts == {script for script, _, _ in CASES.values()} | set(NOT_RUN)


@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_prints_one_json_line_with_its_keys(smoke: Path, name: str) -> None:
    ran = json.loads((smoke / f"{name}.json").read_text())
    stderr = (smoke / f"{name}.stderr").read_text()
    assert ran["returncode"] == 0, f"{CASES[name][0]} exited {ran['returncode']}:\n{stderr[-4000:]}"
    lines = (smoke / f"{name}.stdout").read_text().strip().splitlines()
    assert lines, f"{CASES[name][0]} printed nothing:\n{stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    missing = CASES[name][2] - set(result)
    assert not missing, f"{CASES[name][0]}: no {sorted(missing)} in its JSON line"


@pytest.mark.parametrize("script", list(NOT_RUN))
def test_benchmark_not_run(script: str) -> None:
    pytest.skip(f"benchmarks/{script}: {NOT_RUN[script]}")
