"""Which training steps log: the steps where a cross-rank reduction of a logged value is worth its cost."""

from __future__ import annotations

from typing import Any


def is_logging_step(trainer: Any) -> bool:
    """True on the steps Lightning writes to the logger (every `log_every_n_steps`, and when stopping).

    Lightning's own rule (`_LoggerConnector.should_update_logs`), read where it lives: Lightning has no public
    accessor. Without a Trainer (a module used alone) every step counts as logged.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return True if connector is None else bool(connector.should_update_logs)


def module_logs_now(module: Any) -> bool:
    """is_logging_step for a LightningModule (True when it is not attached to a Trainer)."""
    return is_logging_step(getattr(module, "_trainer", None))


def reduced_on_logging_steps(module: Any, value: Any, reduce_op: str = "mean") -> Any:
    """A value to `self.log` WITHOUT sync_dist: reduced across ranks (`strategy.reduce`, what sync_dist=True
    computes) on the steps the logger writes, this rank's own between them (what the progress bar and
    callbacks monitoring it see there). sync_dist=True would reduce on every step: on a GPU a stream sync and
    a collective per logged value per step."""
    value = value.detach()
    trainer = getattr(module, "_trainer", None)
    if trainer is None or not is_logging_step(trainer):
        return value
    return trainer.strategy.reduce(value.clone(), reduce_op=reduce_op)  # a copy: collectives reduce in place
