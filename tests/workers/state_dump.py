"""A callback for the multi-rank tests: the full (unsharded) model and optimizer state at train start or end,
written by rank 0, keyed by parameter name, so that runs on different meshes can be compared."""

from __future__ import annotations

from typing import Literal

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict


class DumpFullState(Callback):
    def __init__(self, path: str, when: Literal["start", "end"] = "end") -> None:
        self.path, self.when = path, when

    def _dump(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer = trainer.optimizers[0]
        model = get_model_state_dict(module, options=options)
        optim = get_optimizer_state_dict(module, optimizer, options=options)  # full on rank 0 only (cpu_offload)
        if trainer.global_rank == 0:
            torch.save({"model": model, "optimizer": optim["state"]}, self.path)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.when == "start":
            self._dump(trainer, module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.when == "end":
            self._dump(trainer, module)
