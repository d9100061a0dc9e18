"""A user's own transformer without a plan (issue #38): per-block FSDP units found or named (auto_wrap_policy,
wrap() in configure_model), FSDPStrategy's arguments, CPU offload and checkpoints crossing with FSDPStrategy, each
against the same model in a plain single-device loop (tests/workers/own_model_runs.py). One launch per world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import launch

TWO_RANKS = [
    "found_blocks",  # dp=2
    "auto_wrap_policy",  # dp=2 (the default: dp fills the world), units by policy, activation_checkpointing_policy
    "found_blocks_checkpointed",  # selective activation checkpointing on every 2nd found block
    "sharding_strategies",  # SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP)
    "manual_wrap",
    "cpu_offload",
    "checkpoints_cross",
    "transformers_model",  # a LlamaForCausalLM in the user's own LightningModule, dp=2
]
FOUR_RANKS = ["found_blocks", "auto_wrap_policy", "hsdp", "hsdp_device_mesh_auto_wrap"]  # dp=4, hsdp 2x2


def _launch(tmp: Path, nproc: int, runs: list[str]) -> list[dict]:
    proc = launch(nproc, "own_model_runs.py", str(tmp), *runs, timeout=600)
    ranks = [json.loads(f.read_text()) if (f := tmp / f"rank{r}.json").is_file() else {} for r in range(nproc)]
    failed = [
        f"rank {r}, {run}:\n{result['error']}"
        for r, rs in enumerate(ranks)
        for run, result in rs.items()
        if not result["ok"]
    ]
    assert proc.returncode == 0, "\n".join(failed) or proc.stdout[-3000:] + proc.stderr[-5000:]
    return ranks


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("own2"), 2, TWO_RANKS)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("own4"), 4, FOUR_RANKS)


def _ok(ranks: list[dict], run: str) -> None:
    for rank, results in enumerate(ranks):
        assert results[run]["ok"], f"rank {rank}, {run}:\n{results[run]['error']}"


@pytest.mark.parametrize("run", TWO_RANKS)
def test_two_ranks(two: list[dict], run: str) -> None:
    _ok(two, run)


@pytest.mark.parametrize("run", FOUR_RANKS)
def test_four_ranks(four: list[dict], run: str) -> None:
    _ok(four, run)
