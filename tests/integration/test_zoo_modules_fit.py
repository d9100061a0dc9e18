"""The zoo's LightningModules train end to end on one CPU process (a whole Trainer.fit each: out of the unit tier)."""

from __future__ import annotations

import math

import lightning as L

from tests.unit.test_zoo import _trainer
from zoo import DigitsDataModule, GPTModule, TextDataModule, ViTModule


def test_gpt_module_fits_on_text(tmp_path):
    (tmp_path / "a.txt").write_text("hello world, " * 400)
    data = TextDataModule(global_batch_size=4, seq_len=16, source=str(tmp_path), val_fraction=0.1)
    module = GPTModule(lr=1e-2, warmup_steps=2, config_overrides={"n_layers": 1})
    trainer = _trainer(max_steps=12, limit_val_batches=2, num_sanity_val_steps=0, val_check_interval=6)
    trainer.fit(module, data)
    assert module.model.config.n_layers == 1
    assert trainer.callback_metrics["train_loss"] < math.log(256)  # learnt something
    assert "val_loss" in trainer.callback_metrics
    logits = trainer.predict(module, data)[0]
    assert logits.shape == (4, 16, 256)
    assert module.lr_schedulers() is not None


def test_vit_module_fits_on_synthetic_digits():
    L.seed_everything(0)
    data = DigitsDataModule(global_batch_size=64, source="synthetic", synthetic_samples=512)
    module = ViTModule(lr=3e-3)
    trainer = _trainer(max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, data)
    metrics = trainer.test(module, data, verbose=False)[0]
    assert metrics["test_acc"] > 0.25  # 10 classes: chance is 0.1 (0.47 after these 14 steps)
    assert set(metrics) == {"test_loss", "test_acc"}
