"""The chosen plan as a `lit-mesh fit` config (LightningCLI YAML: MeshStrategy init_args, zoo GPT, text data)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lit_mesh.planner.hardware import Hardware
from lit_mesh.planner.search import Candidate


def fit_config(c: Candidate, preset: str, overrides: dict[str, Any], hw: Hardware, max_steps: int) -> dict[str, Any]:
    layout, work = c.layout, c.work
    strategy: dict[str, Any] = {
        "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "tp": layout.tp, "cp": layout.cp,
        "pp": layout.pp, "sequence_parallel": layout.tp > 1, "activation_checkpointing": c.ac,
    }
    steps = work.microbatches(layout)
    if layout.pp > 1:  # the schedule runs every micro-batch of the step
        strategy.update(pp_schedule="1f1b", pp_microbatches=steps)
        accumulate, per_batch = 1, work.global_batch
    else:  # Lightning accumulates micro-batches; each DataModule batch is one micro-batch per dp rank
        accumulate, per_batch = steps, work.global_batch // steps
    model: dict[str, Any] = {"preset": preset}
    if overrides:
        model["config_overrides"] = dict(overrides)
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "auto", "devices": hw.devices_per_node, "num_nodes": hw.nodes,
            "precision": c.precision, "max_steps": max_steps, "accumulate_grad_batches": accumulate,
            "gradient_clip_val": 1.0, "log_every_n_steps": 10,
            "strategy": {"class_path": "lit_mesh.MeshStrategy", "init_args": strategy},
            "callbacks": [{"class_path": "lit_mesh.MeshMonitor"}],
        },
        "model": {"class_path": "zoo.GPTModule", "init_args": model},
        "data": {"class_path": "zoo.TextDataModule", "init_args": {"global_batch_size": per_batch, "seq_len": work.seq_len}},
    }


def write_fit_config(path: str | Path, c: Candidate, preset: str, overrides: dict[str, Any], hw: Hardware,
                     max_steps: int, header: list[str]) -> Path:
    path = Path(path)
    body = yaml.safe_dump(fit_config(c, preset, overrides, hw, max_steps), sort_keys=False)
    comments = "".join(f"# {line}\n" for line in header)
    path.write_text(comments + body)
    return path
