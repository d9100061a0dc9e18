"""What a new user meets first, in-process: pictures in the logger and the step-counting progress bar (the
subprocess checks of the command line and the extras are in tests/integration/test_first_contact.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest


def test_pictures_reach_the_loggers_that_take_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 0)  # loggers write on rank 0 only; other tests may have set it

    from lit_mesh.extras import pyplot
    from lit_mesh.monitor.figures import log_image
    from tests.tensorboard_images import image_tags

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    png = tmp_path / "picture.png"
    fig.savefig(png)
    plt.close(fig)

    class ImageLogger(CSVLogger):  # the shape of W&B's / Neptune's log_image
        def log_image(self, key: str, images: list, step: int | None = None) -> None:
            self.logged = (key, images, step)

    tensorboard = TensorBoardLogger(tmp_path / "tb")
    other = ImageLogger(tmp_path / "other")
    trainer = SimpleNamespace(loggers=[tensorboard, CSVLogger(tmp_path / "csv"), other])
    assert log_image(trainer, "pipeline_timeline", png, step=3) == ["TensorBoardLogger", "ImageLogger"]
    assert image_tags(tmp_path / "tb") == {"pipeline_timeline"}
    assert other.logged == ("pipeline_timeline", [str(png)], 3)


def test_progress_bar_counts_steps_in_a_step_limited_run(tmp_path: Path) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from lit_mesh.training.progress import StepRichProgressBar, StepTQDMProgressBar, count_steps_in_progress_bar

    for bar, twin in ((RichProgressBar(), StepRichProgressBar), (TQDMProgressBar(), StepTQDMProgressBar)):
        trainer = Trainer(max_steps=7, callbacks=[bar], logger=False, default_root_dir=tmp_path)
        count_steps_in_progress_bar(trainer)
        assert type(trainer.progress_bar_callback) is twin and trainer.progress_bar_callback is bar
    by_epochs = Trainer(max_epochs=2, callbacks=[RichProgressBar()], logger=False, default_root_dir=tmp_path)
    count_steps_in_progress_bar(by_epochs)
    assert type(by_epochs.progress_bar_callback) is RichProgressBar  # an epoch-limited run keeps "Epoch N"

    class Mine(RichProgressBar):
        pass

    mine = Trainer(max_steps=7, callbacks=[Mine()], logger=False, default_root_dir=tmp_path)
    count_steps_in_progress_bar(mine)
    assert type(mine.progress_bar_callback) is Mine  # a user's own bar is left alone


def test_a_step_limited_fit_shows_step_n_of_max_steps(tmp_path: Path) -> None:
    """Through MeshStrategy on one device: the bar Lightning made reads `step 3/3` at the end."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import RichProgressBar

    from lit_mesh import MeshStrategy
    from lit_mesh.cli import close_process_groups
    from zoo import GPTModule, TextDataModule

    bar = RichProgressBar(leave=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MeshStrategy(),
        max_steps=3,
        limit_val_batches=0,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    try:
        trainer.fit(GPTModule(preset="tiny"), TextDataModule(global_batch_size=4, seq_len=32))
    finally:
        close_process_groups()
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert task.description.strip() == "step 3/3", task.description


def test_every_recipe_logs_the_learning_rate_and_the_gradient_norm() -> None:
    import yaml

    from tests.launch import REPO

    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert len(recipes) >= 6
    for recipe in recipes:
        callbacks = {c["class_path"] for c in yaml.safe_load(recipe.read_text())["trainer"].get("callbacks", [])}
        assert {"lightning.pytorch.callbacks.LearningRateMonitor", "lit_mesh.GradientNormMonitor"} <= callbacks, (
            recipe.name
        )


# ---- what installed packages add to the command (entry points), stood in for by monkeypatching entry_points --------

PLUGIN_MODULE = """
from lightning.pytorch import LightningModule

from lit_mesh.planner.families import ModelFamily
from zoo.gpt import GPT, GPTConfig

CALLS = []


class PluginModule(LightningModule):  # known to LightningCLI by its short name once the family's modules are imported
    def __init__(self, width: int = 3) -> None:
        super().__init__()


def main(argv):
    CALLS.append(argv)


FAMILY = ModelFamily(name="plugin", config_class=GPTConfig, presets={}, build=GPT, flops_per_token=lambda c, t: 0.0,
                     lightning_module="lit_mesh_plugin.PluginModule", data_module="zoo.TextDataModule",
                     cli_modules=("lit_mesh_plugin",))
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from importlib.metadata import EntryPoint

    import lit_mesh.cli
    from lit_mesh.planner import families

    (tmp_path / "lit_mesh_plugin.py").write_text(PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lit_mesh_plugin", raising=False)
    installed = {
        families.GROUP: [EntryPoint(name="plugin", value="lit_mesh_plugin:FAMILY", group=families.GROUP)],
        lit_mesh.cli.COMMANDS_GROUP: [
            EntryPoint(name="hello", value="lit_mesh_plugin:main", group=lit_mesh.cli.COMMANDS_GROUP)
        ],
    }
    monkeypatch.setattr(families, "entry_points", lambda group: installed.get(group, []))
    monkeypatch.setattr(lit_mesh.cli, "entry_points", lambda group: installed.get(group, []))
    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))


def test_an_installed_command_is_listed_without_importing_it_and_runs(
    plugin: None, capsys: pytest.CaptureFixture
) -> None:
    import sys

    from lit_mesh.cli import overview, run

    hello = [line for line in overview().splitlines() if line.split()[:1] == ["hello"]]
    assert hello[0].split() == ["hello", "from", "lit_mesh_plugin", "(`lit-mesh", "hello", "--help`)"], hello
    assert "lit_mesh_plugin" not in sys.modules
    run(["hello", "a", "--b"])
    assert sys.modules["lit_mesh_plugin"].CALLS == [["a", "--b"]]


def test_short_class_paths_of_a_familys_cli_modules_resolve(plugin: None, capsys: pytest.CaptureFixture) -> None:
    """`lit-mesh fit --model=PluginModule`: the family's cli_modules are imported before LightningCLI parses (the
    zoo's: `--model=GPTModule`)."""
    from lit_mesh.cli import run
    from tests.launch import REPO

    with pytest.raises(SystemExit) as exit_:
        run(["fit", "-c", str(REPO / "configs/gpt.yaml"), "--model=PluginModule", "--model.width=5", "--print_config"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "class_path: lit_mesh_plugin.PluginModule" in out and "width: 5" in out, out[
        -3000:
    ]
