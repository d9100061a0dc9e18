"""A callback that kills rank 0 in the middle of a checkpoint save at a given step (after the shards are
written, before the metadata and the rename), the way a node failure would. `skip` saves of that step
complete first (ModelCheckpoint writes {step}.ckpt, then last.ckpt)."""

from __future__ import annotations

import os

import lightning as L
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Callback


class DieDuringSave(Callback):
    def __init__(self, step: int, skip: int = 0) -> None:
        self.step, self.skip = step, skip

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step != self.step:
            return
        write_shards = dcp.save
        saves = [0]

        def save_then_die(*a: object, **kw: object) -> object:
            result = write_shards(*a, **kw)
            saves[0] += 1
            if saves[0] > self.skip and trainer.global_rank == 0:
                os._exit(17)
            return result

        dcp.save = save_then_die  # ModelCheckpoint runs after this callback in the same hook
