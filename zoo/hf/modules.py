"""LightningModules around transformers models, for `lit-mesh fit --model=zoo.hf.HFCausalLM ...`.

Plain Lightning code: nothing here names a mesh. MeshStrategy finds the transformers model and its plan.
`build="configure_model"` (default) creates the model under the strategy's meta-device context (each rank
then materialises only its shards, initialised as transformers would); `build="init"` creates it in
`__init__`, whole on every rank (as with `from_pretrained`), and the strategy shards it.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F

from lit_mesh.extras import require
from lit_mesh.kernels import adamw_implementation
from lit_mesh.log_steps import reduced_on_logging_steps
from zoo.hf.configs import tiny_config

Build = Literal["configure_model", "init"]


class _HFModule(L.LightningModule):
    def __init__(self, architecture: str, lr: float, build: Build, config_overrides: dict[str, Any] | None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = tiny_config(architecture, **(config_overrides or {}))
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


class HFCausalLM(_HFModule):
    """Next-token prediction with a transformers causal LM (llama, qwen2, mistral, mixtral, gpt2); batches are
    (tokens, targets), both (B, T), as zoo.TextDataModule gives them."""

    def __init__(
        self,
        architecture: str = "llama",
        lr: float = 3e-3,
        build: Build = "configure_model",
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(architecture, lr, build, config_overrides)

    def create_model(self) -> torch.nn.Module:
        AutoModelForCausalLM = require("transformers").AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(self.config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.log("train_loss", reduced_on_logging_steps(self, loss), prog_bar=True)  # no per-step collective
        return loss


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
        AutoModelForImageClassification = require("transformers").AutoModelForImageClassification

        return AutoModelForImageClassification.from_config(self.config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.model(pixel_values=images).logits.float(), labels)
        self.log("train_loss", reduced_on_logging_steps(self, loss), prog_bar=True)  # no per-step collective
        return loss
