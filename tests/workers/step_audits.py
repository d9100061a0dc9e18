"""The audited layouts of tests/test_host_sync.py and benchmarks/host_sync.py: 4-step `lit-mesh fit` runs whose
step 2 logs nothing (log_every_n_steps=2) and is counted by lit_mesh.monitor.step_audit.StepAudit; every step of them
but the audited one also runs under tests/collective_devices.py's check for host tensors in collectives (NCCL
refuses them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tests.launch import REPO, cli_runs

S = "--trainer.strategy.init_args."
AUDITED_STEP = 2
# Without gradient clipping (its global norm is one scalar all-reduce per group of gradients, over the FSDP
# group: the world here), except in fsdp2-clip.
NO_CLIP = "--trainer.gradient_clip_val=null"
# name -> (config, world size, extra CLI args)
LAYOUTS = {
    "fsdp2": ("gpt.yaml", 2, [f"{S}dp=2", NO_CLIP]),
    "fsdp2-clip": ("gpt.yaml", 2, [f"{S}dp=2"]),
    "ddp2": ("gpt.yaml", 2, [f"{S}dp_replicate=2", NO_CLIP]),
    "ddp2-onebit": ("gpt.yaml", 2, [f"{S}dp_replicate=2", f"{S}grad_compression=onebit", NO_CLIP]),
    "ddp2-powersgd": ("gpt.yaml", 2, [f"{S}dp_replicate=2", f"{S}grad_compression=powersgd", NO_CLIP]),
    "pp2": ("gpt.yaml", 2, [f"{S}pp=2", f"{S}pp_schedule=1f1b", NO_CLIP]),
    "cp2": ("gpt.yaml", 2, [f"{S}cp=2", NO_CLIP]),
    "moe-ep2": ("moe.yaml", 2, [f"{S}dp=2", f"{S}ep=2", NO_CLIP]),
    # selective AC keeps the counts' exchange and their host copy: its recompute reads nothing again
    "moe-ep2-selective": ("moe.yaml", 2, [f"{S}dp=2", f"{S}ep=2", f"{S}activation_checkpointing=selective", NO_CLIP]),
    "fsdp2xtp2": ("gpt.yaml", 4, [f"{S}dp=2", f"{S}tp=2", NO_CLIP]),
}


def audit_args(config: str, out: Path, name: str, extra: list[str], devices: int) -> list[str]:
    """CLI args of a 4-step run whose step 2 is audited into out/NAME/audit.json."""
    return [
        "-c",
        str(REPO / "configs" / config),
        f"--trainer.devices={devices}",
        "--trainer.max_steps=4",
        "--trainer.log_every_n_steps=2",
        "--trainer.logger=CSVLogger",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
        "--seed_everything=0",
        "--trainer.callbacks+=lit_mesh.monitor.step_audit.StepAudit",
        f"--trainer.callbacks.init_args.step={AUDITED_STEP}",
        f"--trainer.callbacks.init_args.out={out / name / 'audit.json'}",
        "--trainer.callbacks+=tests.collective_devices.CollectiveDevices",
        f"--trainer.callbacks.init_args.out={out / name / 'collective_devices'}",
        f"--trainer.callbacks.init_args.skip_steps=[{AUDITED_STEP}]",
        *extra,
    ]


def run_audits(out: Path, names: Sequence[str] = tuple(LAYOUTS)) -> dict[str, dict]:
    """The layouts `names` (every one by default), one launch per world size; {name: the audit file (every rank's
    counts), with "host_tensor_collectives": per rank, the collectives that took a host tensor
    (tests/collective_devices.py)}."""
    by_world: dict[int, list[dict]] = {}
    for name in names:
        config, world, extra = LAYOUTS[name]
        by_world.setdefault(world, []).append({"name": name, "args": audit_args(config, out, name, extra, world)})
    for world, runs in sorted(by_world.items()):
        cli_runs(world, out, runs)
    audits = {name: json.loads((out / name / "audit.json").read_text()) for name in names}
    for name, audit in audits.items():
        found = out / name / "collective_devices"
        audit["host_tensor_collectives"] = [
            json.loads((found / f"rank{rank}.json").read_text()) for rank in range(audit["world_size"])
        ]
    return audits
