"""LightningModules around transformers models, for `lit-mesh fit --model=zoo.hf.HFCausalLM ...`.

Plain Lightning code: nothing here names a mesh. MeshStrategy finds the transformers model and its plan.
`build="configure_model"` (default) creates the model under the strategy's meta-device context (each rank
then materialises only its shards, initialised as transformers would); `build="init"` creates it in
`__init__`, whole on every rank (as with `from_pretrained`), and the strategy shards it.

`HFCausalLM(pretrained=DIR)` starts from a transformers directory instead of a tiny config: the config comes
from DIR, and after the strategy has sharded the model each rank reads only its slices of DIR's safetensors
(`pretrained_sources()`, read by lit_mesh.checkpoint.pretrained); without MeshStrategy the whole model is read in
configure_model.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from typing_extensions import override

from lit_mesh.checkpoint.pretrained import fill_parameters
from lit_mesh.extras import require
from lit_mesh.kernels import adamw_implementation
from lit_mesh.parallel.pipeline import loss_of
from lit_mesh.training.log_steps import reduced_on_logging_steps, step_mean
from zoo.hf.configs import tiny_config
from zoo.pretrained import CAUSAL_LMS, FromPretrained, hf_sources, read_config

Build = Literal["configure_model", "init"]


class _HFModule(L.LightningModule):
    def __init__(
        self, architecture: str, lr: float, build: Build, config_overrides: dict[str, Any] | None, config: Any = None
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.config = config if config is not None else tiny_config(architecture, **(config_overrides or {}))
        self.model: torch.nn.Module | None = None
        if build == "init":
            self.model = self.create_model()
        elif build != "configure_model":
            raise ValueError(f"build={build!r}; choose 'configure_model' or 'init'")

    def create_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def configure_model(self) -> None:
        if self.model is None:  # the hook may run more than once (fit, then test)
            self.model = self.create_model()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.95), **adamw_implementation(self.parameters())
        )


class HFCausalLM(FromPretrained, _HFModule):
    """Next-token prediction with a transformers causal LM (llama, qwen2, mistral, mixtral, gpt2); batches are
    (tokens, targets), both (B, T), as zoo.TextDataModule and zoo.TokenDataModule give them.

    pretrained:    a transformers directory (config.json + safetensors) to start from; `architecture` is then
                   read from it, and `config_overrides` may change only what leaves the tensor shapes alone
    warmup_steps, decay_steps, min_lr_ratio: with decay_steps > 0, transformers' cosine schedule with linear
                   warm-up down to min_lr_ratio x lr at decay_steps (per optimizer step)
    Logged: train_loss, val_loss and val_ppl (torchmetrics' Perplexity); the gradient norm by the recipes'
    lit_mesh.GradientNormMonitor.
    """

    def __init__(
        self,
        architecture: str = "llama",
        lr: float = 3e-3,
        build: Build = "configure_model",
        config_overrides: dict[str, Any] | None = None,
        pretrained: str | None = None,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        decay_steps: int = 0,
        min_lr_ratio: float = 0.1,
    ) -> None:
        config = None
        if pretrained is not None:
            config = read_config(pretrained, CAUSAL_LMS)
            config.update(config_overrides or {})
        if decay_steps and decay_steps <= warmup_steps:
            raise ValueError(
                f"decay_steps={decay_steps} must be 0 (no schedule) or more than warmup_steps={warmup_steps}"
            )
        super().__init__(architecture, lr, build, config_overrides, config)
        if pretrained is not None:  # every tensor named and shape-checked now, before any rank starts
            from zoo.convert.rules import build_on_meta

            self._sources = hf_sources(build_on_meta(type(self).create_model_of, self.config), pretrained)
            if self.model is not None:  # build="init": the model exists whole
                fill_parameters(self.model, self._sources)
        self.val_ppl: torch.nn.Module | None = None  # made at each validation start

    @staticmethod
    def create_model_of(config: Any) -> torch.nn.Module:
        return require("transformers").AutoModelForCausalLM.from_config(config)

    def create_model(self) -> torch.nn.Module:
        return self.create_model_of(self.config)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        # loss_of: under pp the schedule runs the micro-batches (the model's own call runs it with labels, which
        # transformers shifts itself; these targets are shifted already)
        loss = loss_of(self.model, _next_token_loss, tokens, targets)
        self.log(
            "train_loss", reduced_on_logging_steps(self, step_mean(self, "train_loss", loss)), prog_bar=True
        )  # no per-step collective
        return loss

    @override
    def on_validation_epoch_start(self) -> None:
        # a new metric: MeshStrategy's materialisation (to_empty on the whole module) leaves the state and the
        # defaults that reset() restores uninitialised
        from torchmetrics.text import Perplexity

        self.val_ppl = Perplexity().to(self.device)

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        logits = self(tokens).float()
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1), targets.flatten()), prog_bar=True, sync_dist=True)
        self.val_ppl.update(logits, targets)  # summed negative log-likelihood and token count, reduced over ranks
        self.log("val_ppl", self.val_ppl, prog_bar=True, metric_attribute="val_ppl")

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0] if isinstance(batch, (tuple, list)) else batch)

    @override
    def configure_optimizers(self) -> Any:
        h = self.hparams
        optimizer = torch.optim.AdamW(
            self.parameters(),
            lr=h.lr,
            betas=(0.9, 0.95),
            weight_decay=h.weight_decay,
            **adamw_implementation(self.parameters()),
        )
        if not h.decay_steps:
            return optimizer
        get_cosine_with_min_lr_schedule_with_warmup = require(
            "transformers"
        ).get_cosine_with_min_lr_schedule_with_warmup
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=h.warmup_steps, num_training_steps=h.decay_steps, min_lr_rate=h.min_lr_ratio
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _next_token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (a transformers output's, or a pipeline's last stage's) against shifted targets."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class HFImageClassifier(_HFModule):
    """Image classification with a transformers ViTForImageClassification; batches are (images, labels)."""

    def __init__(
        self,
        architecture: str = "vit",
        lr: float = 1e-3,
        build: Build = "configure_model",
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(architecture, lr, build, config_overrides)

    def create_model(self) -> torch.nn.Module:
        return require("transformers").AutoModelForImageClassification.from_config(self.config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(pixel_values=images).logits.float(), labels)
        self.log(
            "train_loss", reduced_on_logging_steps(self, step_mean(self, "train_loss", loss)), prog_bar=True
        )  # no per-step collective
        return loss
