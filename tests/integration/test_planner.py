"""lit-mesh plan: the YAML it writes (the scaled-down rehearsal of a Llama-3 8B plan) trains on 4 ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from lit_mesh.planner.command import main as plan_main
from tests.launch import cli_runs


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, dict, str]:
    status = plan_main([*argv, "--json"])
    out = capsys.readouterr().out
    return status, json.loads(out.strip().splitlines()[-1]), out


def test_written_yaml_trains(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """Three plans of the tiny presets on 4 CPU processes: fsdp 2 x tp 2 under a memory budget that forces gradient
    accumulation, pp 2 x fsdp 2 with its micro-batches, and the MoE with ep 2; and the rehearsal of a llama3-8b
    plan on 8 GPUs (dp_shard 4 x cp 2, fixed), scaled to dp_shard 2 x cp 2 of the tiny GPT, and of an interleaved
    pipeline plan (pp_schedule, pp_stages_per_rank, pp_microbatches). The written configs train through
    `lit-mesh fit`, in one launch."""
    common = [
        "--preset",
        "tiny",
        "--devices",
        "4",
        "--devices-per-node",
        "4",
        "--reserve-gib",
        "0",
        "--precision",
        "32-true",
        "--seq-len",
        "64",
        "--dp-replicate",
        "1",
        "--cp",
        "1",
    ]
    tp_yaml, pp_yaml = tmp_path / "tp.yaml", tmp_path / "pp.yaml"
    _, tp_plan, _ = _run(
        capsys,
        *common,
        "--memory-gb",
        "0.003",
        "--global-batch",
        "16",
        "--tp",
        "2",
        "--pp",
        "1",
        "--ac",
        "selective",
        "--inter-node-gbps",
        "25",
        "--out",
        str(tp_yaml),
    )
    _, pp_plan, _ = _run(
        capsys,
        *common,
        "--memory-gb",
        "1",
        "--global-batch",
        "8",
        "--pp",
        "2",
        "--tp",
        "1",
        "--ac",
        "full",
        "--config-overrides",
        "{n_layers: 4}",
        "--out",
        str(pp_yaml),
    )
    assert tp_plan["ranked"][0]["microbatches"] == 2, "the budget should force 2 accumulated micro-batches"
    tp_config, pp_config = (yaml.safe_load(p.read_text()) for p in (tp_yaml, pp_yaml))
    assert (
        tp_config["trainer"]["accumulate_grad_batches"] == 2
        and tp_config["data"]["init_args"]["global_batch_size"] == 8
    )
    assert (
        tp_config["trainer"]["strategy"]["init_args"]
        | {"dp_shard": 2, "tp": 2, "activation_checkpointing": "selective"}
        == tp_config["trainer"]["strategy"]["init_args"]
    )
    # the links it was planned with go to MeshStrategy(topology=...), read from the YAML when it trains below
    assert tp_config["trainer"]["strategy"]["init_args"]["topology"]["inter_node_bandwidth"] == 25e9
    pp_args = pp_config["trainer"]["strategy"]["init_args"]
    assert (
        pp_args["pp"] == 2
        and pp_args["dp_shard"] == 2
        and pp_args["pp_microbatches"] == pp_plan["ranked"][0]["microbatches"]
    )
    assert pp_config["model"]["init_args"]["config_overrides"] == {"n_layers": 4}
    # the zoo MoE (tiny: 4 experts) with ep fixed to 2 on fsdp 4: its YAML names MoEModule and ep
    moe_yaml = tmp_path / "moe.yaml"
    _, moe_plan, _ = _run(
        capsys,
        "--model",
        "moe",
        *common,
        "--memory-gb",
        "1",
        "--global-batch",
        "8",
        "--tp",
        "1",
        "--pp",
        "1",
        "--ep",
        "2",
        "--out",
        str(moe_yaml),
    )
    moe_config = yaml.safe_load(moe_yaml.read_text())
    assert moe_plan["ranked"][0]["layout"]["ep"] == 2 and moe_config["model"]["class_path"] == "zoo.MoEModule"
    assert moe_config["trainer"]["strategy"]["init_args"]["ep"] == 2
    # the real plan for llama3-8b on one node of 8 GPUs, rehearsed on 4 CPU processes with the same mesh shape
    rehearsal_yaml = tmp_path / "rehearsal.yaml"
    _, eight_b, text = _run(
        capsys,
        "--preset",
        "llama3-8b",
        "--devices",
        "8",
        "--dp-shard",
        "4",
        "--cp",
        "2",
        "--rehearsal",
        str(rehearsal_yaml),
    )
    assert eight_b["ranked"][0]["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 1, "ep": 1}, (
        text
    )
    rehearsal = yaml.safe_load(rehearsal_yaml.read_text())
    rehearsal_args = rehearsal["trainer"]["strategy"]["init_args"]
    assert {d: rehearsal_args[d] for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")} == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 2,
        "tp": 1,
    }
    assert rehearsal["trainer"]["devices"] == 4 and rehearsal["trainer"]["accelerator"] == "cpu"
    assert rehearsal["model"]["init_args"] == {"preset": "tiny"} and rehearsal["trainer"]["precision"] == "32-true"
    # an interleaved plan (llama3-8b, pp 2 x dp_shard 4, 4 micro-batches: v stages per rank shrink the bubble),
    # rehearsed as pp 2 x dp_shard 2 of the tiny GPT deepened to one block per stage, with the plan's schedule
    interleaved_yaml = tmp_path / "interleaved.yaml"
    _, interleaved, text = _run(
        capsys,
        "--preset",
        "llama3-8b",
        "--devices",
        "8",
        "--pp",
        "2",
        "--dp-shard",
        "4",
        "--global-batch",
        "16",
        *("--ac", "selective", "full"),  # checkpointing: the split-backward schedules (ZBV, zero bubble) left out
        "--rehearsal",
        str(interleaved_yaml),
    )
    best = interleaved["ranked"][0]
    assert best["pp_schedule"] == "interleaved_1f1b" and best["pp_stages_per_rank"] >= 2, text
    interleaved_args = yaml.safe_load(interleaved_yaml.read_text())["trainer"]["strategy"]["init_args"]
    assert (interleaved_args["pp"], interleaved_args["pp_schedule"], interleaved_args["pp_stages_per_rank"]) == (
        2,
        "interleaved_1f1b",
        best["pp_stages_per_rank"],
    )
    overrides = [
        "--trainer.max_steps=4",
        "--trainer.accelerator=cpu",
        "--trainer.logger=CSVLogger",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_model_summary=false",
    ]
    runs = [
        {"name": name, "args": ["-c", str(path), *overrides]}
        for name, path in (
            ("tp", tp_yaml),
            ("pp", pp_yaml),
            ("moe", moe_yaml),
            ("rehearsal", rehearsal_yaml),
            ("interleaved", interleaved_yaml),
        )
    ]
    results = cli_runs(4, tmp_path, runs, timeout=500)
    for name in ("tp", "pp", "moe", "rehearsal", "interleaved"):
        losses = [v for _, v in sorted(results[name]["metrics"]["train_loss"].items(), key=lambda kv: int(kv[0]))]
        assert results[name]["world_size"] == 4 and len(losses) == 4
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (name, losses)
