"""FaultInjector: rehearse failures before a big run.

FaultInjector: rehearse failures before a big run (a dead rank, a NaN loss, a slow rank, a hung collective,
a pre-emption signal).

    trainer = Trainer(strategy=MeshStrategy(...), callbacks=[FaultInjector("kill", step=7, rank=1)])

or on the command line: `--trainer.callbacks+=lit_mesh.FaultInjector --trainer.callbacks.fault=kill
--trainer.callbacks.step=7 --trainer.callbacks.rank=1`. With `attempts="first"` (the default) the fault
happens only in the first attempt of a launch (torchrun --max-restarts, SLURM requeue), so a restart can show
that the run recovers; `attempts="always"` repeats it in every attempt.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from typing import Any, Literal, cast

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint import FileSystemWriter
from typing_extensions import override

from lit_mesh.reliability.elastic import restart_attempt

Fault = Literal["kill", "nan_loss", "slow", "hang", "sigterm", "disk_full"]
FAULTS = ("kill", "nan_loss", "slow", "hang", "sigterm", "disk_full")


class FaultInjector(Callback):
    """Inject a fault (kill, NaN loss, slow, hang, SIGTERM, disk full) at one step on one rank.

    At optimizer step `step` (trainer.global_step) on global rank `rank`:

    - "kill": the process exits at once with `exit_code` (no cleanup, as on a node failure);
    - "nan_loss": that step's training loss is NaN on that rank;
    - "slow": the rank sleeps `seconds` before the step (a straggler);
    - "hang": the rank stops before the step and never returns, so the other ranks wait in their next
      collective (what the strategy's timeout must end);
    - "sigterm": the rank receives SIGTERM, as from a scheduler pre-empting the job (see lit_mesh.Preemption);
    - "disk_full": the rank's next sharded checkpoint write fails with OSError(ENOSPC).

    attempts: "first" (only in the launch's first attempt) or "always".
    """

    def __init__(
        self,
        fault: Fault,
        step: int,
        rank: int = 0,
        attempts: Literal["first", "always"] = "first",
        seconds: float = 5.0,
        exit_code: int = 13,
    ) -> None:
        if fault not in FAULTS:
            raise ValueError(f"FaultInjector(fault={fault!r}): choose one of {', '.join(FAULTS)}")
        if attempts not in ("first", "always"):
            raise ValueError(f"FaultInjector(attempts={attempts!r}): choose 'first' or 'always'")
        if step < 0 or rank < 0:
            raise ValueError(f"FaultInjector(step={step}, rank={rank}): both must be >= 0")
        self.fault, self.step, self.rank, self.attempts = fault, step, rank, attempts
        self.seconds, self.exit_code = seconds, exit_code

    def _due(self, trainer: L.Trainer) -> bool:
        return (
            trainer.global_step == self.step
            and trainer.global_rank == self.rank
            and (self.attempts == "always" or restart_attempt() == 0)
        )

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._due(trainer):
            return
        if self.fault == "kill":
            os._exit(self.exit_code)
        elif self.fault == "slow":
            time.sleep(self.seconds)
        elif self.fault == "hang":
            print(
                f"[rank {trainer.global_rank}] FaultInjector: hanging before step {self.step}",
                file=sys.stderr,
                flush=True,
            )
            while True:
                time.sleep(60)
        elif self.fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault == "disk_full":
            _fail_next_shard_write()
        elif self.fault == "nan_loss":
            _poison_next_loss(pl_module)


def _poison_next_loss(module: L.LightningModule) -> None:
    """Make the next training_step's loss NaN (an instance attribute shadows the method for one call)."""
    step = module.training_step

    def nan_step(*args: Any, **kwargs: Any) -> Any:
        del module.training_step  # back to the class's method
        output = step(*args, **kwargs)
        if isinstance(output, dict):
            return {**output, "loss": output["loss"] * float("nan")}
        loss = cast(torch.Tensor, output)  # the loss itself when not in a dict
        return loss * torch.tensor(float("nan"), device=loss.device)

    module.training_step = nan_step  # type: ignore[method-assign]


def _fail_next_shard_write() -> None:
    """Make this rank's next checkpoint shard write fail as on a full disk.

    This rank's next shard write fails as on a full disk, inside torch.distributed.checkpoint's write step
    (which then fails the save on every rank together, as a real write error does).
    """
    write_data = FileSystemWriter.write_data

    def disk_full(self: object, *args: Any, **kwargs: Any) -> Any:
        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
        raise OSError(errno.ENOSPC, "No space left on device (injected by lit_mesh.FaultInjector)")

    FileSystemWriter.write_data = disk_full  # type: ignore[method-assign]
