"""The LightningModule of the zoo MoE: loss = LM loss + auxiliary balancing loss; balance logged every step.

Logged: `train_loss` is the LM loss alone (comparable with the zoo GPT), `train_aux_loss` the sum of the MoE
layers' auxiliary losses, `moe/imbalance` the mean over MoE layers of max/mean tokens per expert, and
`moe/tokens_expert_{i}` the tokens routed to expert i in all MoE layers of the global micro-batch.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lit_mesh.log_steps import module_logs_now, reduced_on_logging_steps, step_mean
from zoo.modules import GPTModule, _inputs, _optimizer
from zoo.moe import MoEConfig, MoETransformer, moe_flops_per_token
from zoo.pretrained import FromPretrained, pretrained_zoo


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per expert, per row of `load` (layers, experts): 1 is perfect balance."""
    load = load.float()
    return load.max(dim=-1).values / load.mean(dim=-1).clamp_min(1e-9)


class MoEModule(FromPretrained, L.LightningModule):
    """Next-token language modelling with `zoo.moe.MoETransformer`; batches are (tokens, targets), both (B, T).

    pretrained: a transformers Mixtral directory to start from (its config replaces the preset's)."""

    def __init__(
        self,
        preset: str = "tiny",
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        config_overrides: dict[str, Any] | None = None,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # validate the preset and the routing options now, before any process starts
        self.config = MoEConfig.from_preset(preset, **(config_overrides or {}))
        if pretrained is not None:  # every tensor named and shape-checked now, before any rank starts
            self.config, self._sources = pretrained_zoo(pretrained, "mixtral", config_overrides)
        self.model: MoETransformer | None = None
        self._load_since_step: torch.Tensor | None = None  # (MoE layers, experts), for aux-loss-free balancing

    @override
    def configure_model(self) -> None:
        created = self.model is None  # the hook may run more than once (fit, then test)
        if created:
            self.model = MoETransformer(self.config)
        self._load_if_built(created)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    loss_fn = staticmethod(GPTModule.loss_fn)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        lm_loss = self.loss_fn(self(tokens), targets)
        aux_loss = self.model.aux_loss()
        layers = self.model.moe_layers()
        load = torch.stack([moe.load for moe in layers]).float()  # already global: the same on every rank
        self._load_since_step = load if self._load_since_step is None else self._load_since_step + load
        self.log("train_loss", reduced_on_logging_steps(self, step_mean(self, "train_loss", lm_loss)), prog_bar=True)  # no per-step collective
        # each rank's aux loss uses the global load, so the mean over ranks is the global aux loss
        self.log("train_aux_loss", reduced_on_logging_steps(self, step_mean(self, "train_aux_loss", aux_loss)))
        if module_logs_now(self):
            self._log_balance(layers, load)
        return lm_loss + aux_loss

    def _log_balance(self, layers: list, load: torch.Tensor) -> None:
        self.log("moe/imbalance", imbalance(load).mean())
        for expert, tokens in enumerate(load.sum(dim=0)):
            self.log(f"moe/tokens_expert_{expert}", tokens)
        if self.config.capacity_factor is not None:
            routed = load.sum() / len(layers)  # global assignments per MoE layer
            dropped = torch.stack([moe.dropped for moe in layers]).float().sum() / len(layers)  # this rank's
            self.log("moe/dropped_fraction", reduced_on_logging_steps(self, dropped / routed.clamp_min(1), "sum"))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # aux-loss-free balancing: after backward (recomputation must route as the forward did), before the step
        if self._load_since_step is not None:
            for moe, load in zip(self.model.moe_layers(), self._load_since_step):
                moe.update_expert_bias(load)
            self._load_since_step = None

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", self.loss_fn(self(tokens), targets), prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("test_loss", self.loss_fn(self(tokens), targets), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        logits = self(_inputs(batch))  # under tp, sharded over the vocabulary (the loss takes them so)
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return _optimizer(self, h.lr, tuple(h.betas), h.weight_decay, h.warmup_steps)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the experts a token uses (lit_mesh.MeshMonitor reads it for MFU)."""
        return moe_flops_per_token(self.config, seq_len)
