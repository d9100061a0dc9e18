"""A callback for the MoE parity tests: the full gradients of the router and the experts at the first step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor


class SaveRoutingGradients(L.Callback):
    """Rank 0 writes {parameter name: full gradient} of every router/expert parameter to LOG_DIR/grads.pt
    before the first optimizer step (before clipping). Every rank gathers (full_tensor is a collective)."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != 0:
            return
        grads = {}
        for name, param in pl_module.named_parameters():
            if (".router." in name or ".experts." in name) and param.grad is not None:
                grad = param.grad
                grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().cpu().clone()
        if trainer.global_rank == 0:
            torch.save(grads, Path(trainer.logger.save_dir) / "grads.pt")
