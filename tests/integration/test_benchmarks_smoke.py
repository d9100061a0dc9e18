"""Every benchmark script keeps running: each benchmarks/*.py (not _common.py) at its smallest setting, its last
stdout line one JSON object with the keys its committed result (benchmarks/results/*.json) promises.

The one-process scripts run inside this process (runpy, as `python benchmarks/x.py ARGS` would): the interpreter
and the imports of torch, Lightning and lit-mesh are paid once, not per script. They run in a tmp directory, with
arguments that keep every file they write there: committed results, figures and benchmarks/README.md are never
written. The scripts that launch several ranks (torchrun) cost tens of seconds each on this suite's CPUs: they
are skipped by default with the reason printed (all but overhead.py, which keeps the 2-rank launcher path of
_common.py covered), and run (as subprocesses) with LIT_MESH_BENCH_SMOKE=all.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
RESULTS = BENCHMARKS / "results"
ALL = os.environ.get("LIT_MESH_BENCH_SMOKE") == "all"


@dataclass(frozen=True)
class Smoke:
    """How one script runs at its smallest setting: its arguments ("{tmp}" is the test's tmp directory), the
    committed result whose top-level keys it must print (or the keys themselves), and why it is skipped."""

    argv: tuple[str, ...] = ()
    result: str | None = None  # benchmarks/results/NAME.json
    keys: tuple[str, ...] = ()
    launches_ranks: str | None = None  # why the run is a multi-rank launch (skipped unless LIT_MESH_BENCH_SMOKE=all)
    in_suite: bool = False  # a multi-rank launch run anyway: one, so that the launcher path stays covered
    needs: str | None = None  # a reason it cannot run here at all
    setup: str | None = None  # the name of a function below that prepares {tmp}


RANKS = "launches torchrun ranks (tens of seconds on the suite's CPUs)"
TINY_STEPS = ("--preset", "tiny", "--steps", "1", "--warmup", "1", "--repeats", "1")
SMOKES: dict[str, Smoke] = {
    "planner.py": Smoke(("--presets", "small", "--devices", "8", "--moe-presets", "--no-simulate"), "planner"),
    "tp_bytes.py": Smoke(("--preset", "small", "--tokens", "64"), "tp_bytes"),
    "memory.py": Smoke(
        ("--loss-only", "--loss-vocab", "256", "--loss-tokens", "32", "--loss-chunks", "2"), "memory_loss"
    ),
    "moe.py": Smoke(
        ("--part", "balance", "--balance-steps", "3", "--balance-batch", "2", "--balance-seq-len", "16"), "moe_balance"
    ),
    "gpu.py": Smoke(  # its CPU path: the tiny preset, no compile
        (
            "--preset",
            "tiny",
            "--batch-size",
            "1",
            "--seq-len",
            "16",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--compile-backend",
            "none",
        ),
        "gpu_h100",
    ),
    "startup.py": Smoke(
        ("--preset", "small", "--world", "2"),
        keys=("benchmark", "preset", "world", "rank", "parameters", "local_parameters", "seconds", "cpu_seconds"),
    ),
    "tensorboard_scalars.py": Smoke(("{tmp}/logs",), keys=("benchmark", "log_dir", "scalars"), setup="event_file"),
    "compile_tp_repro.py": Smoke(
        ("--backend", "eager", "--cases", "eager-sp"), "compile_tp_inductor", launches_ranks=RANKS
    ),
    "compression.py": Smoke(
        ("--modes", "fp32", "--preset", "tiny", "--steps", "2"), "compression", launches_ranks=RANKS
    ),
    "context_parallel.py": Smoke(
        ("--cp", "1", "2", "--seq-len", "64", "--budget-mib", "0"), "context_parallel", launches_ranks=RANKS
    ),
    "hf.py": Smoke(("--dp", "2", "--tp", "1", *TINY_STEPS), "hf", launches_ranks=RANKS),
    "host_sync.py": Smoke((), "host_sync", launches_ranks=RANKS),
    "loss_curves.py": Smoke(("--steps", "2", "--png", "{tmp}/loss.png"), "loss_curves", launches_ranks=RANKS),
    "memory_zero.py": Smoke(needs="a module of benchmarks/memory.py --zero (covered by memory.py's launch)"),
    "overhead.py": Smoke(("--dp", "1", "--tp", "2", *TINY_STEPS), "overhead", launches_ranks=RANKS, in_suite=True),
    "pipeline.py": Smoke(
        ("--schedules", "1f1b", "--preset", "tiny", "--steps", "2", "--warmup", "1"), "pipeline", launches_ranks=RANKS
    ),
    "pretrained_load.py": Smoke(
        ("--ranks", "2", "--hidden", "384", "--layers", "1", "--vocab", "128"), "pretrained_load", launches_ranks=RANKS
    ),
    "token_loader.py": Smoke(
        ("--seq-len", "64", "--global-batch-size", "2", "--vocab", "300", "--workers", "1", "--max-batches", "2"),
        "token_loader",
        launches_ranks="prepare-data processes over the whole standard library (minutes)",
    ),
    "topology.py": Smoke(
        ("--simulate", "2x2", "--mib", "0.01", "--presets", "small"), "topology", launches_ranks=RANKS
    ),
    "vs_modelparallel.py": Smoke(("--dp", "1", "--tp", "2", *TINY_STEPS), "vs_modelparallel", launches_ranks=RANKS),
    "report.py": Smoke(("--check",), needs="renders benchmarks/README.md (tests/unit/test_report.py covers it)"),
}


def event_file(tmp: Path) -> None:
    """A TensorBoard event file with one scalar for tensorboard_scalars.py to read."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp / "logs"))
    writer.add_scalar("train_loss", 1.0, 0)
    writer.close()


def test_every_benchmark_script_has_a_smoke_entry() -> None:
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - {"_common.py"}
    assert scripts == set(SMOKES), f"add or drop entries: {sorted(scripts ^ set(SMOKES))}"


def promised_keys(smoke: Smoke) -> set[str]:
    if smoke.result is None:
        return set(smoke.keys)
    return set(json.loads((RESULTS / f"{smoke.result}.json").read_text())["result"])


def last_json_line(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no stdout"
    result = json.loads(lines[-1])
    assert isinstance(result, dict), lines[-1][:300]
    return result


@pytest.mark.parametrize("script", sorted(SMOKES))
def test_benchmark_runs_tiny(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    smoke = SMOKES[script]
    if smoke.needs:
        print(f"skipped {script}: {smoke.needs}")
        pytest.skip(smoke.needs)
    if smoke.launches_ranks and not (ALL or smoke.in_suite):
        print(f"skipped {script}: {smoke.launches_ranks}; LIT_MESH_BENCH_SMOKE=all runs it")
        pytest.skip(f"{smoke.launches_ranks}; LIT_MESH_BENCH_SMOKE=all runs it")
    if smoke.setup:
        globals()[smoke.setup](tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in smoke.argv]
    before = {p: p.stat().st_mtime_ns for p in [*RESULTS.glob("*.json"), BENCHMARKS / "README.md"]}
    monkeypatch.chdir(tmp_path)
    if smoke.launches_ranks:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(
            [sys.executable, str(BENCHMARKS / script), *argv], capture_output=True, text=True, env=env, timeout=900
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout = proc.stdout
    else:
        monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *argv])
        monkeypatch.syspath_prepend(str(BENCHMARKS))  # `import _common` as when run as a script
        for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):  # a script reads LOCAL_RANK as "inside a torchrun rank"
            monkeypatch.delenv(name, raising=False)
        threads, environ = torch.get_num_threads(), dict(os.environ)
        try:
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
        finally:  # a Trainer run in this process sets rank variables and threads: the next script starts clean
            torch.set_num_threads(threads)
            os.environ.clear()
            os.environ.update(environ)
        stdout = capsys.readouterr().out
    result = last_json_line(stdout)
    missing = promised_keys(smoke) - set(result)
    assert not missing, f"{script}: the last stdout line lacks {sorted(missing)}"
    after = {p: p.stat().st_mtime_ns for p in before}
    assert after == before, "a smoke run wrote a committed result or benchmarks/README.md"
