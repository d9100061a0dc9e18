"""Small image-classification data: scikit-learn's 8x8 digits (ships with sklearn, no download) or synthetic."""

from __future__ import annotations

from typing import Literal

import torch

from lit_mesh.extras import require
from zoo.global_batches import Batch, GlobalBatchDataModule


def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as (N, 1, 8, 8) float32 in [0, 1] and (N,) long labels."""
    digits = require("sklearn.datasets").load_digits()  # only this source needs scikit-learn
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    return images, torch.tensor(digits.target, dtype=torch.long)


def synthetic_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Class-dependent images: a fixed random template per class plus noise, clipped to [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(10, 1, 8, 8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels] + 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    return images.clamp(0.0, 1.0), labels


class DigitsDataModule(GlobalBatchDataModule):
    """10-class 8x8 grey images; batches are (images (B, 1, 8, 8) float32, labels (B,) long).

    The split is a seeded permutation (the same for every layout); images are normalised with the
    training split's mean and standard deviation.
    """

    def __init__(
        self,
        global_batch_size: int = 32,
        source: Literal["digits", "synthetic"] = "digits",
        val_fraction: float = 0.2,
        seed: int = 0,
        synthetic_samples: int = 2048,
    ) -> None:
        super().__init__(global_batch_size, seed)
        if source not in ("digits", "synthetic"):
            raise ValueError(f"DigitsDataModule: source={source!r}; choose 'digits' or 'synthetic'")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        self.save_hyperparameters()
        self.source = source
        self.val_fraction = val_fraction
        self.synthetic_samples = synthetic_samples
        self.images: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.images is not None:
            return
        if self.source == "digits":
            images, labels = load_digit_images()
        else:
            images, labels = synthetic_images(self.synthetic_samples, self.seed)
        # shuffle once so that validation is not the last writers' digits
        split = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
        images, labels = images[split], labels[split]
        self.val_samples = int(len(labels) * self.val_fraction)
        self.train_samples = len(labels) - self.val_samples
        train = images[: self.train_samples]
        self.images = ((images - train.mean()) / train.std()).contiguous()
        self.labels = labels

    def make_train_batch(self, indices: torch.Tensor) -> Batch:
        assert self.images is not None and self.labels is not None, "call setup() first"
        return self.images.index_select(0, indices), self.labels.index_select(0, indices)  # see zoo/text_data.py

    def make_val_batch(self, indices: torch.Tensor) -> Batch:
        return self.make_train_batch(indices + self.train_samples)
