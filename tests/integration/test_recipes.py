"""Every recipe runs a few steps through the `lit-mesh` console script, the way users start it: Lightning's
launcher spawns the ranks. Then validate, test and predict run from the saved sharded checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import REPO, run_command

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def lit_mesh(*args: str, timeout: float = 300) -> str:
    proc = run_command(["lit-mesh", *args], timeout)
    assert proc.returncode == 0, f"lit-mesh {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def test_quickstart_recipe(tmp_path: Path) -> None:
    out = lit_mesh(
        "fit", "-c", str(REPO / "configs/quickstart.yaml"), "--trainer.max_steps=4", "--trainer.log_every_n_steps=2", "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1", f"--trainer.logger.init_args.save_dir={tmp_path}", *QUIET,
    )  # fmt: skip
    assert "dp_shard=2 x cp=1 x tp=2 (world size 4" in out  # the mesh the README promises
    events = list(tmp_path.rglob("events.out.tfevents*"))
    assert events, "TensorBoard logs are written"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set().union(*(EventAccumulator(str(e)).Reload().Tags()["scalars"] for e in events))
    assert {"train_loss", "tokens_per_s", "monitor/step_time_s", "monitor/comm_mib/tp"} <= tags, tags


@pytest.mark.parametrize(
    ("recipe", "mesh", "after"),
    [
        ("gpt", ["--trainer.strategy.init_args.tp=2"], ["validate", "predict"]),
        ("vit", ["--trainer.strategy.init_args.dp_replicate=2"], ["test"]),
        ("moe", ["--trainer.strategy.init_args.ep=2"], ["validate"]),  # expert weights sharded over ep in the checkpoint
    ],
)
def test_recipe_fit_then_evaluate_from_checkpoint(tmp_path: Path, recipe: str, mesh: list[str], after: list[str]) -> None:
    config = str(REPO / f"configs/{recipe}.yaml")
    common = ["-c", config, "--trainer.devices=2", *mesh, "--trainer.logger=CSVLogger", *QUIET]
    lit_mesh(
        "fit", *common, "--trainer.max_steps=3", "--trainer.limit_val_batches=1", f"--trainer.logger.save_dir={tmp_path}",
        "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.save_last=true",
    )  # fmt: skip
    checkpoint = tmp_path / "ckpt" / "last.ckpt"
    assert checkpoint.is_dir(), "MeshStrategy writes sharded checkpoints"
    for command in after:
        out = lit_mesh(
            command, *common, f"--ckpt_path={checkpoint}", "--trainer.limit_val_batches=2",
            "--trainer.limit_test_batches=2", "--trainer.limit_predict_batches=2",
            f"--trainer.logger.save_dir={tmp_path / command}",
        )  # fmt: skip
        if command == "validate":
            assert "val_loss" in out
        if command == "test":
            assert "test_acc" in out
