"""The LightningModule of the zoo MoE: loss = LM loss + auxiliary balancing loss; balance logged every step.

Logged: `train_loss` is the LM loss alone (comparable with the zoo GPT), `train_aux_loss` the sum of the MoE
layers' auxiliary losses, `moe/imbalance` the mean over MoE layers of max/mean tokens per expert, and
`moe/tokens_expert_{i}` the tokens routed to expert i in all MoE layers of the global micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_mesh.parallel.pipeline import is_pipelined, loss_of, sum_over_stages
from lit_mesh.training.log_steps import module_logs_now, reduced_on_logging_steps, step_mean
from zoo.modules import LanguageModule, _optimizer
from zoo.moe import MoEConfig, MoETransformer
from zoo.pretrained import FromPretrained, pretrained_zoo


def imbalance(load: torch.Tensor) -> torch.Tensor:
    """Max / mean tokens per expert, per row of `load`.

    max / mean tokens per expert, per row of `load` (layers, experts): 1 is perfect balance.
    """
    load = load.float()
    return load.max(dim=-1).values / load.mean(dim=-1).clamp_min(1e-9)


class MoEModule(FromPretrained, LanguageModule):
    """Next-token language modelling with `zoo.moe.MoETransformer`; batches are (tokens, targets), both (B, T).

    pretrained: a transformers Mixtral directory to start from (its config replaces the preset's).
    """

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
        self._load_since_step: torch.Tensor | None = None  # (MoE layers, experts), for aux-loss-free balancing

    network = MoETransformer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        # under pp the schedule runs forward and backward here, each stage adding its MoE layers' aux loss to its
        # own backward (lit_mesh/parallel/pipeline/moe.py); the layers then hold the step's load and aux loss
        lm_loss = loss_of(self.model, self.loss_fn, tokens, targets)
        layers = self.model.moe_layers()  # this pipeline stage's (all of them without pp)
        if is_pipelined(self.model):
            aux_loss = torch.stack([moe.aux_loss for moe in layers]).sum() if layers else lm_loss.new_zeros(())
        else:
            aux_loss = self.model.aux_loss()
        if layers:  # each stage updates the bias of its own layers from their global load
            load = torch.stack([moe.load for moe in layers]).float()
            self._load_since_step = load if self._load_since_step is None else self._load_since_step + load
        whole_aux, whole_load, dropped = self._whole_model(aux_loss, layers)
        self.log(
            "train_loss", reduced_on_logging_steps(self, step_mean(self, "train_loss", lm_loss)), prog_bar=True
        )  # no per-step collective
        # each rank's aux loss uses the global load, so the mean over ranks is the global aux loss
        self.log("train_aux_loss", reduced_on_logging_steps(self, step_mean(self, "train_aux_loss", whole_aux)))
        if module_logs_now(self):
            self._log_balance(whole_load, dropped)
        return lm_loss + aux_loss

    def _whole_model(
        self, aux_loss: torch.Tensor, layers: list
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The aux loss, the load and this rank's dropped assignments per MoE layer of the whole model.

        The aux loss, the load (MoE layers, experts) and this rank's dropped assignments per MoE layer of the
        whole model: this rank's layers without pp; under pp each stage fills the rows of its own layers, summed
        over the stages (one small collective per step), so that rank 0 logs every layer.
        """
        if not is_pipelined(self.model):
            dropped = (
                torch.stack([moe.dropped for moe in layers]).float()
                if self.config.capacity_factor is not None
                else None
            )
            return aux_loss, torch.stack([moe.load for moe in layers]).float(), dropped
        c = self.config
        row = {block: n for n, block in enumerate(i for i in range(c.n_layers) if c.is_moe_layer(i))}
        packed = torch.zeros(len(row), c.n_experts + 1, device=aux_loss.device)  # per layer: load, dropped
        for name, block in self.model.layers.named_children():  # names stay the whole model's under pp
            if block.moe is not None:
                packed[row[int(name)], :-1] = block.moe.load
                packed[row[int(name)], -1] = block.moe.dropped
        summed = sum_over_stages(self.model, torch.cat([aux_loss.detach().float().reshape(1), packed.flatten()]))
        packed = summed[1:].view(len(row), c.n_experts + 1)
        return summed[0], packed[:, :-1], packed[:, -1] if c.capacity_factor is not None else None

    def _log_balance(self, load: torch.Tensor, dropped_per_layer: torch.Tensor | None) -> None:
        self.log("moe/imbalance", imbalance(load).mean())
        for expert, tokens in enumerate(load.sum(dim=0)):
            self.log(f"moe/tokens_expert_{expert}", tokens)
        if dropped_per_layer is not None:  # capacity_factor set
            routed = load.sum() / len(load)  # global assignments per MoE layer
            dropped = dropped_per_layer.sum() / len(load)  # this rank's
            self.log("moe/dropped_fraction", reduced_on_logging_steps(self, dropped / routed.clamp_min(1), "sum"))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # aux-loss-free balancing: after backward (recomputation must route as the forward did), before the step
        if self._load_since_step is not None:
            for moe, load in zip(self.model.moe_layers(), self._load_since_step):
                moe.update_expert_bias(load)
            self._load_since_step = None

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return _optimizer(self, h.lr, tuple(h.betas), h.weight_decay, h.warmup_steps)
