"""Lightning behaviour under MeshStrategy on fsdp2 x tp2 (run by tests/integration/test_lightning_features.py).

Usage: torchrun --standalone --nproc_per_node=4 tests/workers/lightning_features.py OUT_JSON
Rank 0 writes what it observed; the test judges it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.tensor import DTensor

from lit_mesh import MeshStrategy
from lit_mesh.training.grad_norm import global_grad_norm
from tests.workers import exit_skipping_teardown
from zoo import GPTModule, TextDataModule


class SyncDistProbe(GPTModule):
    """Logs values that differ per data-parallel rank but are equal on the tp ranks of one replica."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        dp_rank = float(self.trainer.strategy.distributed_sampler_kwargs["rank"])
        self.log("dp_rank_sum", torch.tensor(dp_rank), reduce_fx="sum", sync_dist=True)
        self.log("dp_rank_mean", torch.tensor(dp_rank), sync_dist=True)
        return super().training_step(batch, batch_idx)


class InitProbe(Callback):
    """At the start: is every rank holding a quarter of the weights, and do they equal a one-device init?"""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from zoo.gpt import GPT

        params = list(module.model.named_parameters())
        self.local_fraction = sum(p.to_local().numel() for _, p in params) / sum(p.numel() for _, p in params)
        torch.manual_seed(0)  # what seed_everything(0) gives a one-device run
        reference = dict(GPT(module.config).named_parameters())
        self.max_init_diff = max((p.full_tensor() - reference[name]).abs().max().item() for name, p in params)


class GradientProbe(Callback):
    """Records, after every backward, whether FSDP already reduced gradients, and the global grad norm."""

    def __init__(self) -> None:
        self.reduced_after_backward: list[bool] = []
        self.norms: list[tuple[float, float]] = []

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        grads = [p.grad for p in module.parameters()]
        self.reduced_after_backward.append(all(g is not None for g in grads))

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer) -> None:
        ours = global_grad_norm(list(module.parameters())).item()
        # the same norm from whole gradients, gathered: what one device would compute
        full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in module.parameters()]
        reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full])).item()
        self.norms.append((ours, reference))


class Counts(Callback):
    """How often validation ran, on how many batches, and the largest clipped gradient entry."""

    def __init__(self) -> None:
        self.validations, self.val_batches, self.train_batches, self.max_clipped = 0, 0, 0, 0.0
        self.max_batch_idx = -1

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.validations += 1

    def on_validation_batch_end(self, *args: object, **kwargs: object) -> None:
        self.val_batches += 1

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:  # noqa: ANN001
        self.train_batches += 1
        self.max_batch_idx = max(self.max_batch_idx, batch_idx)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        def record(optimizer: torch.optim.Optimizer, *_: object) -> None:  # runs after clipping
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            self.max_clipped = max([self.max_clipped, *(g.abs().max().item() for g in local if g.numel())])

        trainer.optimizers[0].register_step_pre_hook(record)


def callbacks_and_loops(out: Path) -> dict:
    """EarlyStopping, LearningRateMonitor, val_check_interval, limit_*_batches, clipping by value, max_time."""
    counts = Counts()
    early = EarlyStopping(monitor="val_loss", patience=1, min_delta=100.0)  # no val_loss can improve by 100
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=MeshStrategy(tp=2),
        max_steps=20,
        val_check_interval=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        log_every_n_steps=1,
        logger=CSVLogger(out.parent / "logs"),
        callbacks=[counts, early, LearningRateMonitor("step")],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(warmup_steps=4), TextDataModule(global_batch_size=8, seq_len=32))
    early_stop = {
        "global_step": trainer.global_step,
        "validations": counts.validations,
        "val_batches": counts.val_batches,
        "max_clipped": counts.max_clipped,
        "log_dir": trainer.logger.log_dir,
    }

    timed = Counts()
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=MeshStrategy(tp=2),
        max_steps=100_000,
        max_time={"seconds": 8},
        limit_train_batches=3,
        limit_val_batches=0,
        callbacks=[timed],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(), TextDataModule(global_batch_size=8, seq_len=32))
    steps = torch.tensor([float(trainer.global_step)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    return {
        "early_stop": early_stop,
        "max_time": {
            "global_step": trainer.global_step,
            "max_over_ranks": steps.item(),
            "max_batch_idx": timed.max_batch_idx,
            "train_batches": timed.train_batches,
        },
    }


def validate_after_fit() -> dict:
    """trainer.validate() after trainer.fit() on the same model, with gradient compression hooked in: the plans
    are not applied again (that was refused as "configure_model parallelised the model itself") and the trained
    weights are neither re-initialised nor re-loaded."""
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=MeshStrategy(tp=2, grad_compression="fp16"),
        max_steps=2,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module, data = GPTModule(), TextDataModule(global_batch_size=8, seq_len=32)
    trainer.fit(module, data)
    trained = {name: p.full_tensor().clone() for name, p in module.named_parameters()}
    first = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    second = trainer.validate(module, data, verbose=False)[0]["val_loss"]
    unchanged = all(torch.equal(p.full_tensor(), trained[name]) for name, p in module.named_parameters())
    return {"validate_after_fit": {"val_loss": [first, second], "weights_unchanged": unchanged}}


def main(out: Path) -> None:
    probe, init = GradientProbe(), InitProbe()
    best = ModelCheckpoint(dirpath=out.parent / "best", monitor="train_loss", save_top_k=1, every_n_train_steps=1)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=MeshStrategy(tp=2),
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, init, best],
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(SyncDistProbe(), TextDataModule(global_batch_size=8, seq_len=32))
    observed = {
        "reduced_after_backward": probe.reduced_after_backward,
        "norms": probe.norms,
        "dp_rank_sum": trainer.callback_metrics["dp_rank_sum"].item(),
        "dp_rank_mean": trainer.callback_metrics["dp_rank_mean"].item(),
        "world_size": trainer.world_size,
        "best_model_path": best.best_model_path,
        "decisions": [
            trainer.strategy.reduce_boolean_decision(True),
            trainer.strategy.reduce_boolean_decision(dist.get_rank() == 0),
            trainer.strategy.reduce_boolean_decision(dist.get_rank() == 0, all=False),
        ],
        "local_fraction": init.local_fraction,
        "max_init_diff": init.max_init_diff,
    }
    observed.update(callbacks_and_loops(out))
    observed.update(validate_after_fit())
    if dist.get_rank() == 0:
        out.write_text(json.dumps(observed))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_skipping_teardown()
