"""Pre-emption: save at the next step boundary, stop cleanly and requeue on SIGTERM or SIGUSR1.

Pre-emption: on SIGTERM or SIGUSR1 (SLURM's warning before the time limit), save a checkpoint at the next step
boundary, stop cleanly (exit status 0), and requeue the job under SLURM.

Why our own: Lightning's SIGTERM handling ends the run without a checkpoint, and its SLURM SIGUSR1 handler saves
inside the signal handler, in the middle of a step, where a sharded save's collectives can deadlock.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption(Callback):
    """Checkpoint and stop when the process is told to (SIGTERM, SIGUSR1).

    The signal only sets a flag; at the end of the current step every rank learns whether any rank got one (one
    tiny all-reduce per step), so all save `preempted-step=N.ckpt` together into the ModelCheckpoint's dirpath
    (else `dirpath`, else the trainer's default_root_dir) and stop. A relaunch with `ckpt_path="last"` (lit-mesh)
    resumes from it. requeue: under SLURM, `scontrol requeue` the job ("auto": when SLURM_JOB_ID is set).
    """

    def __init__(self, dirpath: Optional[str] = None, requeue: Any = "auto") -> None:
        self.dirpath = dirpath
        self.requeue = requeue
        self.received: Optional[int] = None
        self.saved: Optional[Path] = None
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, frame: Any) -> None:
        self.received = signum  # nothing else here: the step in flight finishes first

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received = None
        for sig in SIGNALS:  # after Lightning installed its handlers (they would end the run without a save)
            self._previous[sig] = signal.signal(sig, self._note)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            return
        path = self._directory(trainer) / f"preempted-step={trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        self.saved = path
        rank_zero_info(f"pre-empted (signal received): saved {path} at step {trainer.global_step}; stopping")
        trainer.should_stop = True
        if trainer.is_global_zero and self._requeue():
            job = os.environ.get("SLURM_ARRAY_JOB_ID")
            job = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job else os.environ["SLURM_JOB_ID"]
            if subprocess.call(["scontrol", "requeue", job]) != 0:
                rank_zero_warn(f"scontrol requeue {job} failed: relaunch the job by hand (it resumes from {path})")

    def _requeue(self) -> bool:
        return bool(os.environ.get("SLURM_JOB_ID")) if self.requeue == "auto" else bool(self.requeue)

    def _directory(self, trainer: L.Trainer) -> Path:
        if self.dirpath:
            return Path(self.dirpath)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return Path(callback.dirpath)
        return Path(trainer.default_root_dir)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
