"""8-rank layout parity through the `lit-mesh` CLI: the 3-D layouts train the same model on the same global batches
as one device (fp32: relative 1e-4 per step over 10 steps; final full parameters within 1e-4).

All of them run in ONE torchrun launch of 8 gloo ranks (8 ranks on a 2-core machine are slow: one launch, a tiny
model, 10 steps); the single-device references of the recipes they use run in one 1-rank launch. Adding a layout
is one entry of LAYOUTS: its recipe and its strategy arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_hf import INIT, MIXTRAL, TEXT
from tests.integration.test_parity import COMMON, S, _assert_same_curve, losses
from tests.launch import REPO, cli_runs

WORLD = 8
RECIPES = {
    "gpt": ["-c", str(REPO / "configs/gpt.yaml")],
    # interleaved with 2 stages per rank on pp 2: 4 stages need 4 blocks
    "gpt4": ["-c", str(REPO / "configs/gpt.yaml"), "--model.init_args.config_overrides={n_layers: 4}"],
    "moe": ["-c", str(REPO / "configs/moe.yaml")],
    # transformers models in zoo.hf.HFCausalLM, built whole in __init__ (on the meta device transformers' init
    # would run per pipeline stage: docs/transformers.md)
    "hf_gpt2": [*TEXT, "--model.init_args.architecture=gpt2", INIT],
    "hf_mixtral": [*TEXT, MIXTRAL, INIT],
}
QUIET = ["--trainer.limit_val_batches=0"]  # validation under pp: tests/integration/test_pipeline.py
# name: (recipe, MeshStrategy arguments on 8 ranks); compared with the run "<recipe>-single"
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    "gpt-pp2_fsdp2_tp2": ("gpt", [f"{S}pp=2", f"{S}tp=2"]),  # dp_shard fills the rest: 2
    "gpt-fsdp2_cp2_tp2": ("gpt", [f"{S}cp=2", f"{S}tp=2"]),
    "gpt-hsdp2x2_tp2": ("gpt", [f"{S}dp_replicate=2", f"{S}dp_shard=2", f"{S}tp=2"]),
    "gpt-pp2_cp2_tp2-interleaved": (
        "gpt4",
        [f"{S}pp=2", f"{S}cp=2", f"{S}tp=2", f"{S}pp_schedule=interleaved_1f1b", f"{S}pp_stages_per_rank=2"],
    ),
    "moe-pp2_tp2_ep2": ("moe", [f"{S}pp=2", f"{S}tp=2", f"{S}ep=2"]),
    # the walkthrough's dp x tp x pp run on a transformers model: GPT-2 (tied embeddings)
    "hf_gpt2-pp2_fsdp2_tp2": ("hf_gpt2", [f"{S}pp=2", f"{S}tp=2"]),  # tp with sequence parallelism
    # Mixtral's experts split over ep=2 (borrowed from dp_shard=2) and tp=2, FSDP over dp_shard, pp=2 (1F1B)
    "hf_mixtral-pp2_fsdp2_tp2_ep2": ("hf_mixtral", [f"{S}pp=2", f"{S}tp=2", f"{S}ep=2", f"{S}sequence_parallel=false"]),
    # 2-D tensor parallel on a 2 x 2 grid, two replicas averaging their gradients (tp_mode's DDP)
    "gpt-ddp2_tp4-2d": ("gpt", [f"{S}dp_replicate=2", f"{S}tp=4", f"{S}tp_mode=2d", f"{S}sequence_parallel=false"]),
}


def _run(name: str, recipe: str, devices: int, extra: list[str]) -> dict:
    return {"name": name, "args": [*RECIPES[recipe], f"--trainer.devices={devices}", *COMMON, *QUIET, *extra]}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("parity_8rank")
    references = sorted({recipe for recipe, _ in LAYOUTS.values()})
    found: dict = {"_dir": out}
    found.update(cli_runs(1, out, [_run(f"{recipe}-single", recipe, 1, []) for recipe in references]))
    found.update(
        cli_runs(
            WORLD, out, [_run(name, recipe, WORLD, extra) for name, (recipe, extra) in LAYOUTS.items()], timeout=540
        )
    )
    return found


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_8rank_layout_matches_single_device(results: dict, name: str) -> None:
    reference_name = f"{LAYOUTS[name][0]}-single"
    reference, candidate = results[reference_name], results[name]
    assert candidate["world_size"] == WORLD
    ref_losses = losses(reference)
    assert len(set(ref_losses)) == len(ref_losses), "the reference run must actually update the model"
    _assert_same_curve(ref_losses, losses(candidate), name)
    out: Path = results["_dir"]
    ref_params = torch.load(out / reference_name / "params.pt", weights_only=True)
    params = torch.load(out / name / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys(), "every rank's part, under the single-device names"
    for key, ref in ref_params.items():
        diff = (params[key] - ref).abs().max().item()
        assert diff <= 1e-4, f"{name}: parameter {key} differs by {diff}"
