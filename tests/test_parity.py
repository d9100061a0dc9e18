"""Layout parity through the `lit-mesh` CLI: every mesh layout trains the same model on the same global
batches and must match the single-device run step by step (fp32: relative 1e-4 per step over 10 steps)
and in the final full parameters (1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import REPO, cli_runs

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


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every (recipe, layout) run, grouped into one torchrun launch per world size."""
    out = tmp_path_factory.mktemp("parity")
    found: dict[str, dict] = {}
    for nproc in (1, 2, 4):
        runs = [
            {"name": f"{recipe}-{layout}", "args": ["-c", str(REPO / cfg), f"--trainer.devices={n}", *COMMON, *extra]}
            for recipe, cfg in RECIPES.items()
            for layout, (n, extra) in LAYOUTS.items()
            if n == nproc
        ]
        found.update(cli_runs(nproc, out, runs))
    found["_dir"] = {"path": str(out)}
    return found


def losses(result: dict) -> list[float]:
    per_step = result["metrics"]["train_loss"]
    return [per_step[s] for s in sorted(per_step, key=int)]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_mesh_strategy_on_one_device_equals_no_strategy(results: dict, recipe: str) -> None:
    assert losses(results[f"{recipe}-single"]) == losses(results[f"{recipe}-plain"])  # bit-identical


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name not in ("plain", "single")])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_layout_matches_single_device(results: dict, recipe: str, layout: str) -> None:
    reference, candidate = results[f"{recipe}-single"], results[f"{recipe}-{layout}"]
    assert candidate["world_size"] == LAYOUTS[layout][0]
    ref_losses, got = losses(reference), losses(candidate)
    assert len(ref_losses) == len(got) == STEPS
    assert len(set(ref_losses)) == STEPS, "the reference run must actually update the model"
    for step, (a, b) in enumerate(zip(ref_losses, got), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: {layout} loss {b} vs single-device {a}"

    out = Path(results["_dir"]["path"])
    ref_params = torch.load(out / f"{recipe}-single" / "params.pt", weights_only=True)
    params = torch.load(out / f"{recipe}-{layout}" / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys()
    for name, ref in ref_params.items():
        diff = (params[name].float() - ref.float()).abs().max().item()
        assert diff <= 1e-4, f"{layout}: parameter {name} differs by {diff}"
