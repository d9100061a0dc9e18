"""LightningModules that tests/integration/test_hf.py trains besides the zoo's (`--model=tests.workers.hf_modules.X`)."""

from __future__ import annotations

import torch
from typing_extensions import override

from lit_mesh.training.log_steps import reduced_on_logging_steps
from zoo.hf import HFCausalLM


class LabelsCausalLM(HFCausalLM):
    """The loss as user code often writes it: transformers shifts the labels itself (`labels=tokens`), so context
    parallel must shift them over the whole sequence, not within each rank's shard."""

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, _targets = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", reduced_on_logging_steps(self, loss), prog_bar=True)
        return loss
