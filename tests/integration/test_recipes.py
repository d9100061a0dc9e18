"""The quick-start recipe runs through the `lit-mesh` console script, the way users start it: Lightning's launcher
spawns the ranks. Every recipe then fits a few steps and runs validate, test or predict from its saved sharded
checkpoint (the CLI in ranks forked by the test launcher)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import REPO, cli_runs, run_command

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def lit_mesh(*args: str, timeout: float = 300) -> str:
    proc = run_command(["lit-mesh", *args], timeout)
    assert proc.returncode == 0, f"lit-mesh {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


def test_quickstart_recipe(tmp_path: Path) -> None:
    out = lit_mesh(
        "fit",
        "-c",
        str(REPO / "configs/quickstart.yaml"),
        "--trainer.max_steps=4",
        "--trainer.log_every_n_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        *QUIET,
    )
    assert "dp_shard=2 x cp=1 x tp=2 (world size 4" in out  # the mesh the README promises
    events = list(tmp_path.rglob("events.out.tfevents*"))
    assert events, "TensorBoard logs are written"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set().union(*(EventAccumulator(str(e)).Reload().Tags()["scalars"] for e in events))
    assert {"train_loss", "tokens_per_s", "monitor/step_time_s", "monitor/comm_mib/tp"} <= tags, tags


# recipe: (its mesh on 2 ranks, what runs from its checkpoint after the fit, a metric each of those logs)
AFTER_FIT: dict[str, tuple[list[str], dict[str, str]]] = {
    "gpt": (["--trainer.strategy.init_args.tp=2"], {"validate": "val_loss", "predict": ""}),
    "vit": (["--trainer.strategy.init_args.dp_replicate=2"], {"test": "test_acc"}),
    "moe": (["--trainer.strategy.init_args.ep=2"], {"validate": "val_loss"}),  # expert weights sharded over ep
}


@pytest.fixture(scope="module")
def fit_then_evaluate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Every recipe's fit with a checkpoint, then its evaluations from that checkpoint: one 2-rank launch."""
    out = tmp_path_factory.mktemp("recipes")
    runs = []
    for recipe, (mesh, after) in AFTER_FIT.items():
        common = [
            "-c",
            str(REPO / f"configs/{recipe}.yaml"),
            "--trainer.devices=2",
            *mesh,
            "--trainer.logger=CSVLogger",
            *QUIET,
        ]
        checkpoint = out / recipe / "ckpt"
        runs.append(
            {
                "name": f"{recipe}-fit",
                "args": [
                    *common,
                    "--trainer.max_steps=3",
                    "--trainer.limit_val_batches=1",
                    "--trainer.callbacks+=ModelCheckpoint",
                    f"--trainer.callbacks.dirpath={checkpoint}",
                    "--trainer.callbacks.save_last=true",
                ],
            }
        )
        runs += [
            {
                "name": f"{recipe}-{command}",
                "command": command,
                "args": [
                    *common,
                    f"--ckpt_path={checkpoint / 'last.ckpt'}",
                    "--trainer.limit_val_batches=2",
                    "--trainer.limit_test_batches=2",
                    "--trainer.limit_predict_batches=2",
                ],
            }
            for command in after
        ]
    return out, cli_runs(2, out, runs)


@pytest.mark.parametrize("recipe", list(AFTER_FIT))
def test_recipe_fit_then_evaluate_from_checkpoint(fit_then_evaluate: tuple[Path, dict], recipe: str) -> None:
    out, results = fit_then_evaluate
    assert (out / recipe / "ckpt" / "last.ckpt").is_dir(), "MeshStrategy writes sharded checkpoints"
    assert results[f"{recipe}-fit"]["world_size"] == 2
    for command, metric in AFTER_FIT[recipe][1].items():
        result = results[f"{recipe}-{command}"]
        assert result["world_size"] == 2
        if metric:
            values = list(result["metrics"][metric].values())
            assert values and all(value == value for value in values), (command, metric, values)  # logged, not NaN
