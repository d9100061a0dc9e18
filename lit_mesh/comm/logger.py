"""CompressionLogger: log the bytes on the wire of the gradient reductions with any Lightning logger."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class CompressionLogger(Callback):
    """Log the bytes each rank sends in the gradient reductions, per mesh dim, and what fp32 would have sent.

    Logs, each training step, `grad_compression/sent_bytes/<dim>` and `.../uncompressed_bytes/<dim>` (what
    this rank sent in that step's gradient reductions, and what the plain collectives would have sent),
    `grad_compression/ratio` and `grad_compression/phase` (position in the schedule). Needs
    MeshStrategy(grad_compression=...).
    """

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        run = getattr(trainer.strategy, "compression_run", None)
        if run is not None:
            metrics = run.metrics()
            if metrics:
                pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)
