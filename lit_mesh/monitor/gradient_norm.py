"""GradientNormMonitor: log the global gradient norm, on logging steps only."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer
from typing_extensions import override

from lit_mesh.training.grad_norm import global_grad_norm
from lit_mesh.training.log_steps import is_logging_step


class GradientNormMonitor(Callback):
    """Log `grad_norm`, the global norm of all gradients.

    Log `grad_norm`: the norm of all gradients as if they were whole on one device (sharded FSDP and
    tensor-parallel gradients, pipeline stages combined), before clipping and after fp16 unscaling.

    It runs on the steps the Trainer logs (every `log_every_n_steps`), so other steps pay nothing; on a logging
    step it costs one norm per mesh group, like clipping (with `gradient_clip_val` set the clip computes it again).
    """

    def __init__(self, norm_type: float = 2.0, name: str = "grad_norm") -> None:
        self.norm_type = float(norm_type)
        self.name = name

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        if not is_logging_step(trainer):
            return
        pipeline: Any = getattr(trainer.strategy, "_pipeline", None)  # stages hold different parameters
        across = pipeline.group if pipeline is not None else None
        params = list(pl_module.parameters())
        norm = global_grad_norm(
            pipeline.norm_parameters(params) if pipeline is not None else params, self.norm_type, across
        )
        pl_module.log(self.name, norm, on_step=True, on_epoch=False)
