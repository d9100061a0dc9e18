"""The chosen plan as a `lit-mesh fit` config (LightningCLI YAML: MeshStrategy init_args, the model family's
LightningModule and DataModule, e.g. the zoo GPT and text data), and its rehearsal: the same mesh shape scaled down
to a CPU smoke run of the family's tiny preset."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.families import family
from lit_mesh.planner.hardware import Hardware
from lit_mesh.planner.memory import Workload
from lit_mesh.planner.pipeline_model import microbatches_refused
from lit_mesh.planner.search import DIMS, Candidate, why_invalid
from lit_mesh.planner.shapes import gpt_shapes
from lit_mesh.planner.vocabulary import ac_every, ac_mode, ac_others


def fit_config(
    c: Candidate, preset: str, overrides: dict[str, Any], hw: Hardware, max_steps: int, model_family: str = "gpt"
) -> dict[str, Any]:
    """MeshStrategy's arguments for the plan (pp: its schedule, stages per rank and micro-batches), the model and
    the data; a dict of what `lit-mesh fit -c` reads."""
    layout, work = c.layout, c.work
    strategy: dict[str, Any] = {
        "dp_replicate": layout.dp_replicate,
        "dp_shard": layout.dp_shard,
        "tp": layout.tp,
        "cp": layout.cp,
        "pp": layout.pp,
        "sequence_parallel": layout.tp > 1,
        "activation_checkpointing": ac_mode(c.ac),
    }
    if ac_every(c.ac) > 1:
        strategy["ac_every_n_blocks"] = ac_every(c.ac)
    if ac_others(c.ac) != "none":
        strategy["ac_other_blocks"] = ac_others(c.ac)
    if layout.ep > 1:
        strategy["ep"] = layout.ep
    if c.zero_stage < 3:
        strategy["zero_stage"] = c.zero_stage
    if c.float8:
        strategy["float8"] = c.float8
    if c.whole_experts:
        strategy["expert_tp"] = 1
    if c.ep_nodes > 1:
        strategy["ep_dispatch"] = "by_node"
    # the links the plan was costed with, so that the run chooses its all-reduce on them too (nodes and devices
    # per node come from the cluster environment and the Trainer)
    strategy["topology"] = {
        "intra_node_bandwidth": hw.intra_node_bandwidth,
        "inter_node_bandwidth": hw.inter_node_bandwidth,
        "intra_node_latency": hw.intra_node_latency,
        "inter_node_latency": hw.inter_node_latency,
    }
    steps = work.microbatches(layout)
    if layout.pp > 1:  # the schedule runs every micro-batch of the step
        strategy.update(pp_schedule=c.schedule.name, pp_microbatches=steps)
        if c.schedule.stages_per_rank > 1:
            strategy["pp_stages_per_rank"] = c.schedule.stages_per_rank
        accumulate, per_batch = 1, work.global_batch
    else:  # Lightning accumulates micro-batches; each DataModule batch is one micro-batch per dp rank
        accumulate, per_batch = steps, work.global_batch // steps
    modules = family(model_family)  # the LightningModule and DataModule it names
    model: dict[str, Any] = {"preset": preset}
    if overrides:
        model["config_overrides"] = dict(overrides)
    return {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "auto",
            "devices": hw.devices_per_node,
            "num_nodes": hw.nodes,
            "precision": c.precision,
            "max_steps": max_steps,
            "accumulate_grad_batches": accumulate,
            "gradient_clip_val": 1.0,
            "log_every_n_steps": 10,
            "strategy": {"class_path": "lit_mesh.MeshStrategy", "init_args": strategy},
            "callbacks": [{"class_path": "lit_mesh.MeshMonitor"}],
        },
        "model": {"class_path": modules.lightning_module, "init_args": model},
        "data": {
            "class_path": modules.data_module,
            "init_args": {"global_batch_size": per_batch, "seq_len": work.seq_len},
        },
    }


REHEARSAL_SEQ_LEN = 64  # tokens per sequence: divisible by 2 x cp (ring attention) and, per cp rank, by tp
REHEARSAL_MICRO_BATCH = 2  # sequences per micro-batch and data-parallel rank


def rehearsal_config(c: Candidate, hw: Hardware, model_family: str = "gpt", max_steps: int = 4) -> dict[str, Any]:
    """A plan scaled down to a CPU smoke run that exercises the same code paths: every mesh dim of degree > 1
    (ep too) becomes 2, the model the family's `tiny` preset (config overrides of the plan are dropped: they size
    the big model), 32-true on CPU, one node of as many processes as the scaled mesh has ranks (ep borrows them),
    the plan's activation checkpointing, gradient accumulation over 2 micro-batches when the plan has several (pp:
    the plan's schedule over pp micro-batches, or the fewest it accepts, and the tiny model deepened to one block
    per stage where it has fewer), a global batch of 2-sequence micro-batches per dp rank, `max_steps` steps.

    Raises ValueError with lit_mesh's reason when the scaled layout would not run on the tiny model."""
    scaled = MeshLayout(**{d: min(getattr(c.layout, d), 2) for d in (*DIMS, "ep")})
    n_micro = max(min(c.work.microbatches(c.layout), 2), scaled.pp)  # the schedules need at least pp micro-batches
    while scaled.pp > 1 and microbatches_refused(c.schedule, scaled.pp, n_micro):
        n_micro += scaled.pp  # DualPipeV: 2 pp
    work = Workload(scaled.dp * REHEARSAL_MICRO_BATCH * n_micro, REHEARSAL_SEQ_LEN, REHEARSAL_MICRO_BATCH)
    small = dataclasses.replace(hw, nodes=1, devices_per_node=scaled.world_size)  # the planned links stay (topology:)
    tiny_config = family(model_family).config("tiny")
    stages = scaled.pp * c.schedule.stages_per_rank
    overrides = {"n_layers": stages} if stages > tiny_config.n_layers else {}
    tiny = gpt_shapes(dataclasses.replace(tiny_config, **overrides))
    reason = why_invalid(scaled, tiny, work, small)  # the checks every plan passes
    if reason:
        raise ValueError(
            f"the rehearsal of {c.name()} scales to {scaled.describe()}, which the tiny {model_family}"
            f" preset cannot run: {reason}"
        )
    rehearsal = dataclasses.replace(c, layout=scaled, work=work, precision="32-true")
    config = fit_config(rehearsal, "tiny", overrides, small, max_steps, model_family)
    config["trainer"].update(accelerator="cpu", log_every_n_steps=1)
    return config


def write_yaml(path: str | Path, config: dict[str, Any], header: list[str]) -> Path:
    path = Path(path)
    # every physical line a comment: a newline in an argument (--config-overrides) can never become a YAML key
    comments = "".join(f"# {part}\n" for line in header for part in (line.splitlines() or [""]))
    path.write_text(comments + yaml.safe_dump(config, sort_keys=False))
    return path


def write_fit_config(
    path: str | Path,
    c: Candidate,
    preset: str,
    overrides: dict[str, Any],
    hw: Hardware,
    max_steps: int,
    header: list[str],
    model_family: str = "gpt",
) -> Path:
    return write_yaml(path, fit_config(c, preset, overrides, hw, max_steps, model_family), header)
