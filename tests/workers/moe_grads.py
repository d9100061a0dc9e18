"""A callback for the MoE parity tests: the full gradients of the router and the experts at the first step, and
how expert parallelism was applied (so that a layout that silently fell back to no EP cannot pass). Under pp each
stage holds its own layers: every rank's part is gathered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class SaveRoutingGradients(L.Callback):
    """Rank 0 writes {parameter name: full gradient} of every router/expert parameter to LOG_DIR/grads.pt
    before the first optimizer step (before clipping). Every rank gathers (full_tensor is a collective), then
    rank 0 merges what every rank holds (pipeline stages hold different layers)."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != 0:
            return
        grads = {}
        for name, param in pl_module.named_parameters():
            if (".router." in name or ".experts." in name) and param.grad is not None:
                grad = param.grad
                grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().cpu().clone()
        grads, layout = _merged(grads), _merged(expert_layout(pl_module))
        if trainer.global_rank == 0:
            torch.save(grads, Path(trainer.logger.save_dir) / "grads.pt")
            (Path(trainer.logger.save_dir) / "expert_layout.json").write_text(json.dumps(layout))


def _merged(local: dict) -> dict:
    """The union of every rank's dict (tiny test models), rank 0's entries first."""
    if not dist.is_initialized():
        return local
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict = {}
    for part in parts:
        for name, value in part.items():
            merged.setdefault(name, value)
    return merged


def expert_layout(module: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per MoE layer: its dispatcher's class, ep, tp and token tp, and the full and rank-local shapes of the expert weights."""
    out = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "dispatcher") and hasattr(sub, "experts"):
            out[name] = {
                "dispatcher": type(sub.dispatcher).__name__,
                "ep": getattr(sub.dispatcher, "ep", 1),
                "tp": getattr(sub.dispatcher, "tp", 1),
                # expert_tp=1: the tp ranks whose sequence shards reach these whole experts
                "token_tp": getattr(getattr(sub.dispatcher, "token_tp_mesh", None), "size", lambda: 1)(),
            }
            for weight, param in sub.experts.named_parameters():
                local = param.to_local() if isinstance(param, DTensor) else param
                out[name].update({weight: list(param.shape), f"{weight}_local": list(local.shape)})
    return out
