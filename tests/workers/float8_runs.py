"""Float8 training (torchao, emulated on CPU) under MeshStrategy on 4 ranks (tests/integration/test_float8.py).

Usage: python tests/workers/float8_runs.py OUT_DIR CHECK[,CHECK...]

Each float8 run trains the tiny GPT for STEPS steps in fp32 with its block linears in float8, beside one fp32 run
without float8 (the reference: by the layout-parity promise every layout trains the same fp32 curve). A float8 run
saves a checkpoint at step RESUME_AT (fsdp2 x tp2); a second run resumes from it and must give the same losses as the uninterrupted
run from there on (float8's scales are computed from each step's values, so nothing else needs restoring).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_utilities.core import rank_zero as rank_zero_module

from lit_mesh import MeshStrategy
from tests.workers import exit_skipping_teardown
from tests.workers.checks import Checks
from zoo import GPTModule, TextDataModule

STEPS = 50
RESUME_AT = 45
# float8 against fp32 on this model, measured over the 50 steps (relative difference of each step's loss): 0.01% at
# step 1, then growing with training, at most 2.4% on a step and 0.29% on average (fsdp4 tensorwise), 2.1% and 0.38%
# (fsdp2 x tp2 tensorwise), 2.0% and 0.43% (fsdp2 x tp2 rowwise, 50 steps; the test runs 15). Allowed: 5% on any step and 1.5% on
# average; a float8 path that broke training (a wrong scale, a lost gradient) is off by far more within a few steps,
# and each run must still train (the last loss below 80% of the first).
LOSS_RTOL = 0.05
MEAN_RTOL = 0.015
SHORT_STEPS = 15  # the runs beside the 50-step one: fewer steps, for the suite's time
WORLD = 4
OUT = Path(sys.argv[1]) if __name__ == "__main__" else Path(".")
check = Checks()


class Losses(Callback):
    """The training loss of every step: the mean over the global batch (each rank's loss is its slice's mean)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach())))


class Captured(logging.Handler):
    """What rank 0 printed through Lightning's rank_zero_info (the layout print)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def fit(
    name: str, steps: int = STEPS, ckpt_path: str | None = None, save_at: int | None = None, **strategy: Any
) -> list[float]:
    losses = Losses()
    callbacks: list[Callback] = [losses]
    if save_at is not None:
        callbacks.append(ModelCheckpoint(OUT / name, every_n_train_steps=save_at, save_top_k=-1, filename="{step}"))
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=MeshStrategy(**strategy),
        precision="32-true",
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=save_at is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(GPTModule(lr=3e-3), TextDataModule(global_batch_size=8, seq_len=32), ckpt_path=ckpt_path)
    return losses.losses


@functools.cache
def reference() -> tuple[float, ...]:
    return tuple(fit("fp32", dp_shard=4))


def assert_tracks_reference(losses: list[float], label: str, steps: int = STEPS) -> None:
    ref = reference()[:steps]
    assert len(losses) == len(ref) == steps, (label, len(losses), len(ref))
    relative = [abs(a - b) / abs(b) for a, b in zip(losses, ref)]
    worst, mean = max(relative), sum(relative) / len(relative)
    if int(os.environ.get("RANK", "0")) == 0 and os.environ.get("FLOAT8_DEBUG"):
        print("DEBUG", label, [round(a, 4) for a in losses], [round(b, 4) for b in ref], flush=True)
    assert worst <= LOSS_RTOL, f"{label}: float8 loss off fp32 by {worst:.4f} relative on a step (allowed {LOSS_RTOL})"
    assert mean <= MEAN_RTOL, f"{label}: float8 loss off fp32 by {mean:.4f} relative on average (allowed {MEAN_RTOL})"
    assert losses[-1] < 0.8 * losses[0], f"{label}: float8 did not train: {losses[0]:.3f} -> {losses[-1]:.3f}"
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"{label}: relative difference from fp32 over {steps} steps: largest {worst:.4f}, mean {mean:.4f}",
            flush=True,
        )


def assert_resumes(name: str, uninterrupted: list[float], **strategy: Any) -> None:
    resumed = fit(f"{name}-resume", ckpt_path=str(OUT / name / f"step={RESUME_AT}.ckpt"), **strategy)
    assert resumed == uninterrupted[RESUME_AT:], (name, resumed, uninterrupted[RESUME_AT:])


def assert_layout_print(lines: list[str]) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return  # rank_zero_info prints on rank 0 only
    report = next(line for line in lines if line.startswith("MeshStrategy: float8"))
    assert "emulated" in report, report
    assert "14 linears converted" in report, report  # 2 blocks x (wq, wk, wv, wo, w1, w2, w3)
    for role in ("attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        assert f"layers.{{0,1}}.{role}\n" in report, report
    assert "kept in high precision: model.output (" in report, report


def fit_captured(name: str, **strategy: Any) -> tuple[list[float], list[str]]:
    captured = Captured()
    logger = rank_zero_module.log  # the logger Lightning's rank_zero_info writes to (set by lightning.pytorch)
    logger.addHandler(captured)
    try:
        return fit(name, **strategy), captured.lines
    finally:
        logger.removeHandler(captured)


@check
def fsdp_tensorwise() -> None:
    """fsdp4: float8 all-gather of the weights without TP styles; loss near fp32 and the layout print (SHORT_STEPS
    for the suite's time: the 50 steps and the resume run on fsdp2 x tp2 below, whose FSDP gathers in float8 too)."""
    losses, lines = fit_captured("fsdp", steps=SHORT_STEPS, dp_shard=4, float8="tensorwise")
    assert_tracks_reference(losses, "fsdp4 tensorwise", SHORT_STEPS)
    assert_layout_print(lines)  # last: rank 0 alone checks it, the other ranks must not wait for it in a collective


@check
def fsdp_tp_tensorwise_compiled_checkpointed() -> None:
    """fsdp2 x tp2 with torchao's float8 TP styles, activation checkpointing and compiled blocks (without sequence
    parallelism: with it, the styles all-gather float8 gradients, which gloo cannot carry; see lit_mesh/parallel/float8.py)."""
    strategy: dict[str, Any] = {
        "dp_shard": 2,
        "tp": 2,
        "sequence_parallel": False,
        "float8": "tensorwise",
        "activation_checkpointing": "full",
        "compile_blocks": True,
        "compile_backend": "aot_eager",
    }
    losses, lines = fit_captured("fsdp-tp", save_at=RESUME_AT, **strategy)
    assert_tracks_reference(losses, "fsdp2 x tp2 tensorwise")
    assert_resumes("fsdp-tp", losses, **strategy)
    assert_layout_print(lines)


@check
def fsdp_tp_rowwise() -> None:
    """fsdp2 x tp2 (sequence parallel) with rowwise scaling: torch's TP styles on the float8 linears, all-gathers in
    high precision."""
    losses = fit("rowwise", steps=SHORT_STEPS, dp_shard=2, tp=2, float8="rowwise")
    assert_tracks_reference(losses, "fsdp2 x tp2 rowwise", SHORT_STEPS)


if __name__ == "__main__":
    check.run(sys.argv[2].split(","))  # each check's Trainers start and reuse the process group
    check.write(OUT, int(os.environ["RANK"]))
    exit_skipping_teardown()
