"""LightningModules that fail on purpose, for the multi-rank error tests."""

from __future__ import annotations

import os

import torch

from zoo import GPTModule


class NaNLossAt(GPTModule):
    """The zoo GPT whose training loss turns NaN at optimizer step `step` on global rank `rank` only."""

    def __init__(self, step: int = 3, rank: int = 1, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.nan_step, self.nan_rank = step, rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == self.nan_step and self.trainer.global_rank == self.nan_rank:
            loss = loss * float("nan")
        return loss


class DieAt(GPTModule):
    """The zoo GPT whose process `rank` dies (as on a node failure) at optimizer step `step`."""

    def __init__(self, step: int = 7, rank: int = 1, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.die_step, self.die_rank = step, rank

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.die_step and self.trainer.global_rank == self.die_rank:
            os._exit(13)
        return super().training_step(batch, batch_idx)
