"""Progress bars that count optimizer steps when the run is limited by steps, not epochs.

Lightning's bars describe the epoch ("Epoch 0/-2" when max_epochs is -1); a step-limited run wants
"step N/max_steps". MeshStrategy turns Lightning's own bar into its step-counting twin at setup.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override


def is_step_limited(trainer: Trainer) -> bool:
    return trainer.max_steps is not None and trainer.max_steps > 0 and trainer.max_epochs in (None, -1)


def step_description(trainer: Trainer) -> str:
    return f"step {trainer.global_step}/{trainer.max_steps}"


class StepRichProgressBar(RichProgressBar):
    """RichProgressBar whose training description is `step N/max_steps` in step-limited runs."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if not is_step_limited(self.trainer):
            return super()._get_train_description(current_epoch)
        return f"{step_description(self.trainer):{len(self.validation_description)}}"

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if self.progress is not None and self.train_progress_bar_id is not None and is_step_limited(trainer):
            self.progress.update(self.train_progress_bar_id, description=self._get_train_description(0))


class StepTQDMProgressBar(TQDMProgressBar):
    """TQDMProgressBar whose training description is `step N/max_steps` in step-limited runs."""

    @override
    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if is_step_limited(trainer):
            self.train_progress_bar.set_description(step_description(trainer))

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if is_step_limited(trainer) and not self.train_progress_bar.disable:
            self.train_progress_bar.set_description(step_description(trainer), refresh=False)


STEP_TWINS: dict[type, type] = {RichProgressBar: StepRichProgressBar, TQDMProgressBar: StepTQDMProgressBar}


def count_steps_in_progress_bar(trainer: Trainer) -> None:
    """Give Lightning's own progress bar (default or passed as is) its step-counting twin's behaviour.

    The instance keeps its identity and settings (theme, refresh rate): only its class changes, to a
    subclass that adds no state. A user's own subclass is left alone.
    """
    bar = trainer.progress_bar_callback
    twin = STEP_TWINS.get(type(bar))
    if twin is not None and is_step_limited(trainer):
        bar.__class__ = twin
