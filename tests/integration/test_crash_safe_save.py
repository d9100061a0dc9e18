"""A process killed during a save leaves the previous checkpoint loadable and marked latest (last.ckpt);
training resumes from it with the loss curve of an uninterrupted run (issue #8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import REPO, cli_runs, launch, torchrun

S = "--trainer.strategy.init_args."


def _args(out: Path, name: str, max_steps: int, *extra: str) -> list[str]:
    return [
        "-c",
        str(REPO / "configs/gpt.yaml"),
        "--trainer.devices=2",
        f"{S}dp=2",
        f"--trainer.max_steps={max_steps}",
        "--trainer.log_every_n_steps=1",
        "--trainer.logger=CSVLogger",
        "--data.global_batch_size=8",
        "--seed_everything=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=ModelCheckpoint",
        f"--trainer.callbacks.dirpath={out / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=5",
        "--trainer.callbacks.filename={step}",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.save_last=true",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("crash")
    spec = out / "crashing.json"
    crashing = [
        {
            "name": "crashing",
            "args": _args(
                out,
                "crashing",
                12,
                "--trainer.callbacks+=tests.workers.crash.DieDuringSave",
                "--trainer.callbacks.step=10",
                "--trainer.callbacks.skip=1",
            ),
        }
    ]
    import json

    spec.write_text(json.dumps(crashing))
    proc = launch(2, "cli_runs.py", str(out), str(spec), timeout=240)
    assert proc.returncode != 0, "rank 0 was killed mid-save: the launch must fail (and not hang)"
    resumed = [
        {"name": "uninterrupted", "args": [*_args(out / "ref", "ref", 10)]},
        {"name": "resumed", "args": [*_args(out / "after", "after", 10), f"--ckpt_path={out / 'ckpt' / 'last.ckpt'}"]},
    ]
    return out, cli_runs(2, out, resumed)


def test_the_interrupted_save_is_not_published(runs: tuple[Path, dict]) -> None:
    # killed while overwriting last.ckpt at step 10 (step=10.ckpt itself was complete)
    out, _ = runs
    ckpt = out / "ckpt"
    assert (ckpt / "step=10.ckpt" / "meta.pt").is_file()
    assert (ckpt / "last.ckpt.partial").is_dir() and not (ckpt / "last.ckpt.partial" / "meta.pt").exists()
    assert (ckpt / "last.ckpt" / "meta.pt").is_file(), "the previous last.ckpt stays whole"


def test_training_resumes_from_the_last_complete_checkpoint(runs: tuple[Path, dict]) -> None:
    _, results = runs
    reference = results["uninterrupted"]["metrics"]["train_loss"]
    resumed = results["resumed"]["metrics"]["train_loss"]
    assert sorted(resumed, key=int) == [str(s) for s in range(5, 10)]  # last.ckpt is still the step-5 one
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])


@pytest.fixture(scope="module")
def rank_death(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, dict]:
    """One launch with torchrun --max-restarts=1: the reference run, then a run whose rank 1 is killed at step 7
    in the first attempt only; the restarted attempt resumes by itself (ckpt_path=last: the step-5 checkpoint);
    then a pre-empted run and its relaunch."""
    import json

    out = tmp_path_factory.mktemp("rank_death")
    kill = [
        "--trainer.callbacks+=lit_mesh.FaultInjector",
        "--trainer.callbacks.fault=kill",
        "--trainer.callbacks.step=7",
        "--trainer.callbacks.rank=1",
    ]
    flush = "--trainer.logger.init_args.flush_logs_every_n_steps=1"  # the killed attempt's steps reach metrics.csv
    # pre-emption: rank 1 gets SIGTERM during step 6; every rank saves at the step's end and stops; a relaunch resumes
    preempt = [
        "--trainer.callbacks+=lit_mesh.Preemption",
        "--trainer.callbacks+=lit_mesh.FaultInjector",
        "--trainer.callbacks.fault=sigterm",
        "--trainer.callbacks.step=6",
        "--trainer.callbacks.rank=1",
        "--trainer.callbacks.attempts=always",
    ]
    runs = [
        {"name": "uninterrupted", "args": _args(out / "ref", "ref", 10)},
        {"name": "restarted", "args": [*_args(out, "restarted", 10, *kill), flush, "--ckpt_path=last"]},
        {"name": "preempted", "args": _args(out / "pre", "pre", 10, *preempt)},
        {"name": "after_preemption", "args": [*_args(out / "pre", "pre", 10), "--ckpt_path=last"]},
    ]
    spec = out / "restart.json"
    spec.write_text(json.dumps(runs))
    proc = torchrun(2, "cli_runs.py", str(out), str(spec), timeout=300, max_restarts=1)  # a hang would fail here
    assert proc.returncode == 0, f"the restarted attempt must finish:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc, {r["name"]: json.loads((out / r["name"] / "result.json").read_text()) for r in runs}


def test_a_dead_rank_is_named_and_restarted(rank_death: tuple) -> None:
    proc, _ = rank_death
    report = proc.stdout + proc.stderr
    assert "rank      : 1" in report and "exitcode  : 13" in report or "exitcode: 13" in report, report[-3000:]


def test_a_restart_resumes_the_uninterrupted_curve(rank_death: tuple) -> None:
    _, results = rank_death
    reference = results["uninterrupted"]["metrics"]["train_loss"]
    restarted = results["restarted"]["metrics"]["train_loss"]
    assert sorted(restarted, key=int) == [str(s) for s in range(10)]  # 0-6 from attempt 1, 5-9 from attempt 2
    for step, loss in restarted.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])


def test_preemption_saves_at_the_step_boundary_and_the_relaunch_continues(rank_death: tuple) -> None:
    proc, results = rank_death
    reference = results["uninterrupted"]["metrics"]["train_loss"]
    preempted = results["preempted"]["metrics"]["train_loss"]
    resumed = results["after_preemption"]["metrics"]["train_loss"]
    assert sorted(preempted, key=int) == [str(s) for s in range(7)], "step 6 finishes, then every rank stops"
    assert sorted(resumed, key=int) == [str(s) for s in range(7, 10)], "resumed from preempted-step=7.ckpt"
    for step, loss in {**preempted, **resumed}.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])
    assert "pre-empted (signal received): saved" in proc.stdout + proc.stderr
