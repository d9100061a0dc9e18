"""Your own model, no parallel plan: data parallelism only.

    python examples/own_model.py --devices 2            # 2 CPU processes (Lightning spawns them), FSDP over 2
    python examples/own_model.py --devices 1 --out single.json

A plain LightningModule (an MLP classifier on synthetic data made here with a fixed seed) trained with
`MeshStrategy(dp=N)`. The model declares no `parallel_plan()`, so the strategy shards each top-level child
of the LightningModule with FSDP2 over the N data-parallel ranks and changes nothing else.

What it shows: the per-step losses are the same on 1 device and on N (up to float rounding), because
- the weights are made in `__init__` after `seed_everything`, so every rank starts from the same full weights
  (FSDP then keeps only each rank's shard);
- every rank reads its own slice of the same global batch: `use_distributed_sampler=False` and the loader
  takes rows `rank::num_replicas` of each global batch, with the data-parallel rank and size from
  `trainer.strategy.distributed_sampler_kwargs` (`global_batch_slice` in examples/_common.py, which the
  examples share with their flags and Trainer). The global batch is therefore the same for any device count.
Rank 0 writes the per-step losses (averaged over the data-parallel ranks) to `--out` as JSON.
"""

from __future__ import annotations

import _common as E  # noqa: N812 (examples/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lit_mesh import MeshStrategy

GLOBAL_BATCH = 16


def make_data(
    n_samples: int, n_features: int = 32, n_classes: int = 4, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic classification: labels from a fixed random linear teacher. Same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, n_features, generator=g)
    teacher = torch.randn(n_features, n_classes, generator=g)
    return x, (x @ teacher).argmax(dim=-1)


class Classifier(L.LightningModule):
    def __init__(
        self, n_features: int = 32, hidden: int = 64, n_classes: int = 4, lr: float = 1e-2, lazy: bool = False
    ) -> None:
        super().__init__()
        self.lr = lr
        self.sizes = (n_features, hidden, n_classes)
        self.losses: list[float] = []
        if not lazy:
            self.configure_model()

    def configure_model(self) -> None:
        # Built here (lazy=True), under MeshStrategy the layers start on the meta device and the strategy
        # materialises them with their reset_parameters(), drawing whole tensors in a fixed order, so the
        # weights are the same on any number of devices.
        if hasattr(self, "body"):
            return
        n_features, hidden, n_classes = self.sizes
        # two top-level children: each becomes one FSDP unit
        self.body = nn.Sequential(nn.Linear(n_features, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)  # mean over this rank's slice; FSDP averages gradients over ranks
        # the loss of the whole global batch: mean over the data-parallel ranks (equal slice sizes)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return E.global_batch_slice(self, *make_data(GLOBAL_BATCH * 64), GLOBAL_BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> list[float]:
    parser = E.parser(__doc__, tp=False)
    parser.add_argument("--lazy", action="store_true", help="build the layers in configure_model (meta device)")
    args = E.parse(parser, argv)

    L.seed_everything(0, verbose=False)
    model = Classifier(lazy=args.lazy)
    trainer = E.trainer(args, MeshStrategy(dp=args.devices))
    trainer.fit(model)
    return E.report(trainer, model.losses, args.out)


if __name__ == "__main__":
    main()
