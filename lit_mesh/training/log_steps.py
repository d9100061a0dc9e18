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


def log_every_n_steps(trainer: Any) -> int:
    """The Trainer's `log_every_n_steps` (Lightning's logger connector sets it on the Trainer without declaring it)."""
    return trainer.log_every_n_steps


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


def accumulates_now(trainer: Any) -> bool:
    """True on a micro-batch whose gradients are accumulated, not yet stepped (Lightning's own rule, read where it
    lives: `_TrainingEpochLoop._should_accumulate`). False without a Trainer or outside fitting."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return bool(loop is not None and getattr(trainer, "training", False) and loop._should_accumulate())


def step_mean(module: Any, name: str, value: Any) -> Any:
    """The mean of `value` over the micro-batches of the optimizer step so far: with accumulate_grad_batches=k,
    the k-th micro-batch returns the loss of the whole step's batch. Lightning logs the last micro-batch's value
    alone, which would make a run that accumulates (a replanned one, lit_mesh/reliability/replan.py) log another
    curve than the same global batches in one step. Summed on the device: no host sync."""
    value = value.detach()
    sums = module.__dict__.setdefault("_lit_mesh_step_sums", {})  # per module and name, beside its parameters
    total, count = sums.get(name, (None, 0))
    total, count = (value if total is None else total + value), count + 1
    mean = total / count if count > 1 else total
    sums[name] = (None, 0) if not accumulates_now(getattr(module, "_trainer", None)) else (total, count)
    return mean
