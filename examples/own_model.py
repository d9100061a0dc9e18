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
  `trainer.strategy.distributed_sampler_kwargs`. The global batch is therefore the same for any device count.
Rank 0 writes the per-step losses (averaged over the data-parallel ranks) to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_mesh import MeshStrategy

GLOBAL_BATCH = 16


def make_data(n_samples: int, n_features: int = 32, n_classes: int = 4, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
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
        dp = self.trainer.strategy.distributed_sampler_kwargs  # {"num_replicas", "rank"} of the data-parallel group
        replicas, rank = dp["num_replicas"], dp["rank"]
        if GLOBAL_BATCH % replicas:
            raise ValueError(f"global batch {GLOBAL_BATCH} is not divisible by {replicas} data-parallel ranks")
        x, y = make_data(GLOBAL_BATCH * 64)
        # rows rank, rank + replicas, ...: local batch k holds this rank's share of global batch k
        local = TensorDataset(x[rank::replicas], y[rank::replicas])
        return DataLoader(local, batch_size=GLOBAL_BATCH // replicas, shuffle=False, drop_last=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON file for the per-step losses (written by rank 0)")
    parser.add_argument("--lazy", action="store_true", help="build the layers in configure_model (meta device)")
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    model = Classifier(lazy=args.lazy)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=MeshStrategy(dp=args.devices),
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # we slice the global batch ourselves (train_dataloader)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        print("losses:", " ".join(f"{v:.6f}" for v in model.losses))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"losses": model.losses, "world_size": trainer.world_size}, f)
    return model.losses


if __name__ == "__main__":
    main()
