"""What the example scripts share: their flags, the Trainer they run, the loader of this rank's slice of each
global batch, and the losses they print and write. Each example keeps its model and its strategy.

`python examples/x.py` puts examples/ on sys.path, so a script imports this file as `_common`.
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader, TensorDataset


def parser(doc: str, tp: bool = True) -> argparse.ArgumentParser:
    """--devices, --max-steps, --out, and --tp (dp = devices / tp) where the example has tensor parallelism."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--devices", type=int, default=1)
    if tp:
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree; dp = devices / tp")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON file for the per-step losses (written by rank 0)")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    tp = getattr(args, "tp", 1)
    if args.devices % tp:
        p.error(f"--tp {tp} must divide --devices {args.devices}")
    return args


def trainer(args: argparse.Namespace, strategy: Strategy) -> L.Trainer:
    """A Trainer that only trains, on CPU, with the example's own data slicing (global_batch_slice)."""
    return L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # we slice the global batch ourselves (global_batch_slice)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def global_batch_slice(
    module: L.LightningModule, inputs: torch.Tensor, targets: torch.Tensor, global_batch: int
) -> DataLoader:
    """This data-parallel rank's share of every global batch: rows rank, rank + replicas, ... of the samples, so
    local batch k holds this rank's part of global batch k, whatever the number of devices."""
    dp = module.trainer.strategy.distributed_sampler_kwargs  # the data-parallel rank and size, not the global ones
    replicas, rank = dp["num_replicas"], dp["rank"]
    if global_batch % replicas:
        raise ValueError(f"global batch {global_batch} is not divisible by {replicas} data-parallel ranks")
    local = TensorDataset(inputs[rank::replicas], targets[rank::replicas])
    return DataLoader(local, batch_size=global_batch // replicas, shuffle=False, drop_last=True)


def report(trainer: L.Trainer, losses: list[float], out: str | None, **extra: object) -> list[float]:
    """Rank 0 prints the per-step losses and writes them, with the world size and `extra`, to `out`."""
    if trainer.is_global_zero:
        print("losses:", " ".join(f"{v:.6f}" for v in losses))
        if out:
            with open(out, "w") as f:
                json.dump({"losses": losses, "world_size": trainer.world_size, **extra}, f)
    return losses
