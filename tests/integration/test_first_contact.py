"""What a new user meets first: `lit-mesh --help` / `--version` / `plan --help` without warnings, a plain
`lit-mesh fit` without LightningCLI's `args` warning, optional extras that name their install command, the
core trained with none of them, pictures in the logger, and the step-counting progress bar."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import REPO

EXTRAS = {"transformers": "hf", "matplotlib": "plots", "sklearn": "vision", "jinja2": "bench", "torchao": "fp8"}


def _user_env() -> dict[str, str]:
    """The environment of a user's shell: warnings at Python's defaults, our sources first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return {**env, "PYTHONPATH": str(REPO)}


def _lit_mesh(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    # the installed console script, as a user types it
    proc = subprocess.run(["lit-mesh", *args], capture_output=True, text=True, timeout=300, env=_user_env(), cwd=cwd)
    assert proc.returncode == 0, f"lit-mesh {' '.join(args)}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _no_warning(proc: subprocess.CompletedProcess) -> None:
    text = proc.stdout + proc.stderr
    assert "warn" not in text.lower(), text[-3000:]


def test_help_lists_every_subcommand_with_one_line_and_no_warning() -> None:
    from lit_mesh.cli import COMMANDS, LIGHTNING_COMMANDS

    proc = _lit_mesh("--help")
    _no_warning(proc)
    for name in [*LIGHTNING_COMMANDS, *COMMANDS]:
        lines = [line for line in proc.stdout.splitlines() if line.split()[:1] == [name]]
        assert len(lines) == 1 and len(lines[0].split()) > 2, (name, proc.stdout)
    assert {"fit", "validate", "test", "predict", "plan", "export"} <= {*LIGHTNING_COMMANDS, *COMMANDS}


def test_plan_help_and_version_print_no_warning() -> None:
    _no_warning(plan := _lit_mesh("plan", "--help"))
    assert "--preset" in plan.stdout
    version = _lit_mesh("--version")
    _no_warning(version)
    import lit_mesh

    assert version.stdout.startswith(f"lit-mesh {lit_mesh.__version__} (torch ") and lit_mesh.__version__ != "0+unknown"


def test_unknown_subcommand_is_named_with_the_list() -> None:
    proc = subprocess.run(["lit-mesh", "fitt"], capture_output=True, text=True, timeout=300, env=_user_env())
    assert proc.returncode != 0 and "unknown subcommand 'fitt'" in proc.stderr and "export" in proc.stderr


def test_a_plain_fit_call_gets_no_lightningcli_args_warning(tmp_path: Path) -> None:
    proc = _lit_mesh("fit", "-c", str(REPO / "configs/gpt.yaml"), "--print_config", cwd=tmp_path)
    assert "args parameter" not in proc.stderr and "LightningCLI" not in proc.stderr, proc.stderr[-3000:]
    assert "class_path: lit_mesh.GradientNormMonitor" in proc.stdout


def _without(modules: str, code: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tests" / "without_packages.py"), modules, code]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_user_env(), cwd=REPO)


@pytest.mark.parametrize(
    ("module", "call"),
    [
        ("transformers", "from zoo.hf.configs import tiny_config; tiny_config('llama')"),
        ("matplotlib", "from lit_mesh.monitor.pipeline_timeline import draw_timeline; draw_timeline([], 't', 'x.png')"),
        ("sklearn", "from zoo.image_data import load_digit_images; load_digit_images()"),
        ("jinja2", "import runpy; runpy.run_path('benchmarks/report.py')"),
        ("torchao", "from lit_mesh import MeshStrategy; MeshStrategy(float8='tensorwise')"),
    ],
)
def test_a_missing_extra_names_its_install_command(module: str, call: str) -> None:
    proc = _without(module, call)
    assert proc.returncode != 0
    assert f"MissingExtraError: {module} is needed for" in proc.stderr, proc.stderr[-3000:]
    assert f"pip install 'lit-mesh[{EXTRAS[module]}]'" in proc.stderr


def test_the_core_trains_with_no_extra_installed(tmp_path: Path) -> None:
    """The quick start's path (zoo GPT, MeshStrategy, TensorBoard) on a machine with none of the extras."""
    code = (
        "import sys\n"
        "from lit_mesh.cli import run, close_process_groups\n"
        f"cli = run(['fit', '-c', 'configs/gpt.yaml', '--trainer.max_steps=2', '--trainer.limit_val_batches=0',"
        f" '--trainer.enable_progress_bar=false', '--trainer.logger.init_args.save_dir={tmp_path}'])\n"
        "close_process_groups()\n"
        f"assert not [m for m in {sorted(EXTRAS)!r} if sys.modules.get(m) is not None]\n"
        "print('trained', cli.trainer.global_step)\n"
    )
    proc = _without(",".join(EXTRAS), code)
    assert proc.returncode == 0 and "trained 2" in proc.stdout, proc.stderr[-4000:]


def test_a_recipe_trains_without_a_logger_and_a_single_device_prints_no_rank_prefix(tmp_path: Path) -> None:
    """`--trainer.logger=false`: the recipe's LearningRateMonitor and lit-mesh's monitors have nothing to log to and
    step aside (Lightning's would stop the run); one device's output names no rank."""
    proc = _lit_mesh(
        "fit",
        "-c",
        str(REPO / "configs/gpt.yaml"),
        "--trainer.logger=false",
        "--trainer.callbacks+=lit_mesh.MeshMonitor",
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--model.init_args.config_overrides={n_layers: 2}",
        cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in text, text[-3000:]
    assert "[rank" not in text, text[-3000:]


_FAILING_FIT = """
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lit_mesh import MeshStrategy

class Failing(BoringModel):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("a planned failure")

Trainer(accelerator="cpu", devices=1, strategy=MeshStrategy(), max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False).fit(Failing())
"""


def test_a_single_device_traceback_carries_no_rank_prefix(tmp_path: Path) -> None:
    """torch prefixes every traceback line with "[rank0]:" once a process group starts; MeshStrategy keeps it only
    where there are ranks to tell apart."""
    proc = subprocess.run(
        [sys.executable, "-c", _FAILING_FIT], capture_output=True, text=True, timeout=300, env=_user_env(), cwd=tmp_path
    )
    assert proc.returncode != 0 and "RuntimeError: a planned failure" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
