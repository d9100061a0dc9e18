"""LightningModules for the zoo models.

The network is created in `configure_model()`: under MeshStrategy that hook runs on the meta device and the
strategy then parallelises and initialises the weights; under any other strategy the model is built and
initialised directly (the same weights for the same seed). Losses are fp32 means over the local batch:
every dp rank holds the same number of tokens (samples), so the mean over ranks is the global mean.

Losses go through `lit_mesh.loss_of(model, loss_fn, inputs, targets)` and outputs through `output_of(model,
inputs)`: plain calls on one device, the pipeline schedule when MeshStrategy pipelines the model (pp > 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lit_mesh.kernels import adamw_implementation
from lit_mesh.loss import cross_entropy
from lit_mesh.parallel.pipeline import loss_of, output_of
from lit_mesh.training.log_steps import reduced_on_logging_steps, step_mean
from zoo.gpt import GPT, GPTConfig
from zoo.pretrained import FromPretrained, pretrained_zoo
from zoo.vit import ViT, ViTConfig


def _optimizer(
    module: L.LightningModule,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    warmup_steps: int,
    variance_freeze_step: int | None = None,
    decay_steps: int = 0,
    min_lr_ratio: float = 0.1,
) -> Any:
    if variance_freeze_step is None:
        optimizer = torch.optim.AdamW(
            module.parameters(),
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            **adamw_implementation(module.parameters()),
        )
    else:  # for 1-bit gradient compression: see lit_mesh/comm/onebit_adam.py
        from lit_mesh.comm.onebit_adam import OneBitAdam

        optimizer = OneBitAdam(
            module.parameters(), lr=lr, betas=betas, weight_decay=weight_decay, freeze_step=variance_freeze_step
        )
    if warmup_steps <= 0 and decay_steps <= 0:
        return optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(warmup_steps, decay_steps, min_lr_ratio))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def lr_factor(warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """The learning-rate multiplier per step: linear warm-up, then an optional cosine decay.

    lr multiplier per step: linear warm-up from 1/warmup_steps to 1; then, with decay_steps > 0, a cosine down
    to min_lr_ratio at step decay_steps (counted from the start), constant after; else constant 1.
    """
    if decay_steps and decay_steps <= warmup_steps:
        raise ValueError(f"decay_steps={decay_steps} must be 0 (no decay) or more than warmup_steps={warmup_steps}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1] (the final lr as a fraction of lr)")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if not decay_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _inputs(batch: Any) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


class ZooModule(L.LightningModule):
    """The base of the zoo's LightningModules.

    The skeleton of the zoo's LightningModules: `self.config` (made in the subclass's __init__ from a preset,
    so that a bad one fails before any rank starts), the network `network(config)` built in configure_model,
    losses through loss_of and outputs through output_of (the pipeline schedule under pp), and the config's
    training FLOPs per token. A subclass calls save_hyperparameters() in its own __init__ (the checkpoint then
    holds its arguments) and sets `network`, `config` and `loss_fn`.
    """

    network: Callable[[Any], nn.Module]  # the network's class, built from the config
    config: Any

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None

    @override
    def configure_model(self) -> None:
        if self.model is None:  # the hook may run more than once (fit, then test)
            self.model = self.network(self.config)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return output_of(self.model, inputs)

    @staticmethod
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = loss_of(self.model, self.loss_fn, inputs, targets)
        self.log(
            "train_loss", reduced_on_logging_steps(self, step_mean(self, "train_loss", loss)), prog_bar=True
        )  # no per-step collective
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(_inputs(batch))

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (lit_mesh.MeshMonitor reads it for MFU)."""
        return self.config.flops_per_token(seq_len)


class LanguageModule(ZooModule):
    """A next-token language model's LightningModule.

    Next-token language modelling: batches are (tokens, targets), both (B, T); losses are the mean cross
    entropy over the local batch's tokens.
    """

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over all tokens of the local batch, in fp32.

        Mean cross entropy over all tokens of the local batch, in fp32: chunked over the tokens, and on the
        vocabulary shards when tp > 1 (lit_mesh/loss.py).
        """
        return cross_entropy(logits, targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("val_loss", loss_of(self.model, self.loss_fn, tokens, targets), prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, targets = batch
        self.log("test_loss", loss_of(self.model, self.loss_fn, tokens, targets), sync_dist=True)


class GPTModule(FromPretrained, LanguageModule):
    """Next-token language modelling with `zoo.gpt.GPT`; batches are (tokens, targets), both (B, T).

    pretrained: a transformers Llama directory to start from (its config replaces the preset's).
    """

    def __init__(
        self,
        preset: str = "tiny",
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        config_overrides: dict[str, Any] | None = None,
        variance_freeze_step: int | None = None,
        decay_steps: int = 0,
        min_lr_ratio: float = 0.1,
        pretrained: str | None = None,
    ) -> None:
        """Create the optimizer and learning-rate schedule.

        variance_freeze_step: None: AdamW; an int: lit_mesh.OneBitAdam, whose second moment freezes after that
        many steps (give it grad_compression's warmup_steps when compressing to 1 bit).
        decay_steps: 0: constant lr after the warm-up; else a cosine down to min_lr_ratio x lr at that step.
        """
        super().__init__()
        self.save_hyperparameters()
        lr_factor(warmup_steps, decay_steps, min_lr_ratio)  # bad values fail here, before any rank starts
        # validate the preset now, not after the trainer has started
        self.config = GPTConfig.from_preset(preset, **(config_overrides or {}))
        if pretrained is not None:  # every tensor named and shape-checked now, before any rank starts
            self.config, self._sources = pretrained_zoo(pretrained, "llama", config_overrides)

    network = GPT

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return _optimizer(
            self,
            h.lr,
            tuple(h.betas),
            h.weight_decay,
            h.warmup_steps,
            h.variance_freeze_step,
            h.decay_steps,
            h.min_lr_ratio,
        )


class ViTModule(ZooModule):
    """Image classification with `zoo.vit.ViT`; batches are (images (B, C, H, W), labels (B,))."""

    def __init__(
        self,
        preset: str = "tiny",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = ViTConfig.from_preset(preset, **(config_overrides or {}))

    network = ViT

    @staticmethod
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the local batch, in fp32."""
        return F.cross_entropy(logits.float(), labels)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        images, labels = batch
        logits = self(images)
        self.log(f"{stage}_loss", self.loss_fn(logits, labels), prog_bar=stage == "val", sync_dist=True)
        accuracy = (logits.argmax(dim=-1) == labels).float().mean()
        self.log(f"{stage}_acc", accuracy, prog_bar=stage == "val", sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        h = self.hparams
        return _optimizer(self, h.lr, (0.9, 0.999), h.weight_decay, h.warmup_steps)

    def tokens_in_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
        """(tokens, tokens per image) of a batch: patches, class token and registers of every image."""
        return len(batch[0]) * self.config.seq_len, self.config.seq_len
