"""The user-model examples train the same on every layout: per-step losses of multi-rank runs equal the
single-device run (fp32: relative 1e-4 per step over 10 steps).

Four launches in all (imports cost most of the time on CPU):
- one plain process runs every example on 1 device;
- one torchrun launch with 2 processes runs every example on each 2-rank layout it supports;
- the way users run it: `python examples/own_model_plan.py --devices 4 --tp 2`, Lightning spawning the ranks
  (FSDP over 2 x TP/SP over 2);
- one launch with 4 processes trains the plain nn.Sequential of examples/pipeline_sequential.py on pp=4 (and pp=2 x
  dp=2) with each schedule that runs its backward whole, and one that splits it (zbv).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.launch import REPO, WORKERS, launch, run_command

STEPS = 10
RTOL = 1e-4
COMMON = ["--max-steps", str(STEPS)]

SINGLE = {
    "own": ("own_model.py", ["--devices", "1"]),
    "own-lazy": ("own_model.py", ["--devices", "1", "--lazy"]),
    "plan": ("own_model_plan.py", ["--devices", "1"]),
    "configure": ("own_model_configure.py", ["--devices", "1"]),
    "sequential": ("pipeline_sequential.py", ["--devices", "1"]),
}
# name: (script, flags, the single-device run it must match)
TWO_RANKS = {
    "own-dp2": ("own_model.py", ["--devices", "2"], "own"),
    "own-lazy-dp2": ("own_model.py", ["--devices", "2", "--lazy"], "own"),  # meta init + reset_parameters
    "plan-tp2": ("own_model_plan.py", ["--devices", "2", "--tp", "2"], "plan"),
    "plan-tp2-no-sp": ("own_model_plan.py", ["--devices", "2", "--tp", "2", "--no-sequence-parallel"], "plan"),
    "plan-dp2": ("own_model_plan.py", ["--devices", "2"], "plan"),
    "configure-tp2": ("own_model_configure.py", ["--devices", "2", "--tp", "2"], "configure"),
    "configure-dp2": ("own_model_configure.py", ["--devices", "2"], "configure"),
}
SEQ = "pipeline_sequential.py"
FOUR_RANKS = {
    "sequential-pp4-1f1b": (SEQ, ["--devices", "4", "--pp", "4"], "sequential"),
    # children per stage given by hand: the first stage holds two convolution stages
    "sequential-pp4-gpipe-split": (
        SEQ,
        ["--devices", "4", "--pp", "4", "--schedule", "gpipe", "--split", "6,3,3,2"],
        "sequential",
    ),
    # two stages per rank, x 2 data-parallel replicas (FSDP units: the Sequential's children)
    "sequential-pp2-dp2-interleaved": (
        SEQ,
        ["--devices", "4", "--pp", "2", "--schedule", "interleaved_1f1b"],
        "sequential",
    ),
    "sequential-pp2-dp2-looped_bfs": (SEQ, ["--devices", "4", "--pp", "2", "--schedule", "looped_bfs"], "sequential"),
    "sequential-pp2-dp2-zbv": (SEQ, ["--devices", "4", "--pp", "2", "--schedule", "zbv"], "sequential"),
}
TWO_BW = ("sequential-pp4-2bw", SEQ, ["--devices", "4", "--pp", "4", "--schedule", "2bw"])  # one step late: own check
USER_PATH = ("plan-dp2-tp2-spawned", "own_model_plan.py", ["--devices", "4", "--tp", "2"], "plan")


def _spec(out: Path, name: str, runs: dict) -> Path:
    spec = out / f"{name}.json"
    spec.write_text(json.dumps([{"name": n, "script": r[0], "args": [*r[1], *COMMON]} for n, r in runs.items()]))
    return spec


def _check(proc, what: str) -> None:
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


@pytest.fixture(scope="module")
def losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("examples")
    worker = str(WORKERS / "examples_runs.py")
    _check(
        run_command([sys.executable, worker, str(out), str(_spec(out, "single", SINGLE))], timeout=240), "1-device runs"
    )
    _check(launch(2, "examples_runs.py", str(out), str(_spec(out, "two", TWO_RANKS)), timeout=300), "2-process runs")
    name, script, flags, _ = USER_PATH
    cmd = [sys.executable, str(REPO / "examples" / script), *flags, *COMMON, "--out", str(out / f"{name}.json")]
    _check(run_command(cmd, timeout=300), " ".join(cmd))
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json") if p.stem not in ("single", "two")}


@pytest.fixture(scope="module")
def pipeline_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("pipeline_examples")
    runs = {**FOUR_RANKS, TWO_BW[0]: (*TWO_BW[1:], "")}
    _check(launch(4, "examples_runs.py", str(out), str(_spec(out, "four", runs)), timeout=420), "4-process runs")
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json") if p.stem != "four"}


def assert_same_losses(expected: list[float], got: list[float], what: str) -> None:
    assert len(got) == len(expected) == STEPS, f"{what}: {len(got)} steps vs {len(expected)}, want {STEPS}"
    for step, (e, g) in enumerate(zip(expected, got)):
        assert abs(g - e) <= RTOL * abs(e), (
            f"{what}: step {step} loss {g!r} vs single device {e!r} (rel {abs(g - e) / abs(e):.2e})"
        )


@pytest.mark.parametrize("name", SINGLE)
def test_single_device_trains(losses: dict[str, dict], name: str) -> None:
    steps = losses[name]["losses"]
    assert losses[name]["world_size"] == 1
    # a real signal to compare against: it changes every step and goes down
    assert len(set(steps)) == STEPS and min(steps[-3:]) < steps[0], steps


@pytest.mark.parametrize("name", [*TWO_RANKS, USER_PATH[0]])
def test_multi_rank_matches_single_device(losses: dict[str, dict], name: str) -> None:
    reference = TWO_RANKS[name][2] if name in TWO_RANKS else USER_PATH[3]
    result = losses[name]
    assert result["world_size"] == (4 if name == USER_PATH[0] else 2)
    assert_same_losses(losses[reference]["losses"], result["losses"], name)


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_pipelined_sequential_matches_single_device(
    losses: dict[str, dict], pipeline_losses: dict[str, dict], name: str
) -> None:
    result = pipeline_losses[name]
    assert result["world_size"] == 4
    assert_same_losses(losses[FOUR_RANKS[name][2]]["losses"], result["losses"], name)


def test_pipelined_sequential_trains_with_2bw(losses: dict[str, dict], pipeline_losses: dict[str, dict]) -> None:
    """PipeDream-2BW applies each batch's gradient one step late: the first loss (the starting weights) is the
    single device's, the later ones are not."""
    single, late = losses["sequential"]["losses"], pipeline_losses[TWO_BW[0]]["losses"]
    assert len(late) == STEPS and abs(late[0] - single[0]) <= RTOL * abs(single[0]), (late, single)
    assert all(abs(a - b) > RTOL * abs(b) for a, b in zip(late[2:], single[2:])), (late, single)


def test_comparison_detects_a_different_run(losses: dict[str, dict]) -> None:
    """The parity check can fail: the examples' losses differ from one another, and a 1e-3 nudge is caught."""
    own = losses["own"]["losses"]
    with pytest.raises(AssertionError):
        assert_same_losses(own, [v * (1 + 1e-3) if i == STEPS - 1 else v for i, v in enumerate(own)], "nudged")
    with pytest.raises(AssertionError):
        assert_same_losses(losses["configure"]["losses"], losses["plan"]["losses"], "another model")


def test_meta_built_model_without_plan_starts_like_an_eager_one(losses: dict[str, dict]) -> None:
    assert losses["own-lazy"]["losses"] == losses["own"]["losses"]


_RECORD_ARGV = """#!/bin/sh
for a in "$@"; do printf '%s\\n' "$a"; done > "$ARGV_OUT"
"""


@pytest.mark.parametrize(
    ("script", "launcher", "env", "cli_after"),
    [
        (
            "examples/slurm/train_gpt.sbatch",
            "srun",
            {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4(x2)"},
            "lit-mesh",
        ),
        ("examples/torchrun.sh", "torchrun", {"NNODES": "2", "NPROC_PER_NODE": "4"}, "lit_mesh.cli"),
    ],
)
def test_multinode_launch_scripts_parse(
    script: str, launcher: str, env: dict, cli_after: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The scripts run with a stand-in launcher that records its arguments (no cluster here): the launcher gets
    the node count and processes per node, and LightningCLI accepts the lit-mesh arguments with the same numbers."""
    import os
    import subprocess

    from lit_mesh.cli import run

    fake = tmp_path / "bin" / launcher
    fake.parent.mkdir()
    fake.write_text(_RECORD_ARGV)
    fake.chmod(0o755)
    argv_out = tmp_path / "argv.txt"
    run_env = {**os.environ, **env, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "ARGV_OUT": str(argv_out)}
    proc = subprocess.run(
        ["bash", str(REPO / script)], env=run_env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    argv = argv_out.read_text().splitlines()
    if launcher == "torchrun":
        assert {"--nnodes=2", "--node-rank=0", "--nproc-per-node=4"} <= set(argv), argv
    cli_args = argv[argv.index(cli_after) + 1 :]
    assert {"--trainer.num_nodes=2", "--trainer.devices=4", "--trainer.strategy.init_args.dp_replicate=8"} <= set(
        cli_args
    )
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        run([*cli_args, "--print_config"])
    printed = capsys.readouterr().out
    assert "num_nodes: 2" in printed and "allreduce: auto" in printed, printed[-2000:]
