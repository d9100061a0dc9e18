"""Single-process tests of the zoo DataModules: layout-independent global batches and exact resume."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from zoo.global_batches import GlobalBatches, dp_rank_and_size
from zoo.image_data import DigitsDataModule
from zoo.text_data import TextDataModule, stdlib_sources


def indices_as_batch(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return indices, indices


def local_batches(dataset: GlobalBatches, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dataset.set_epoch(epoch)
    return list(dataset)


# ---- global batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_slices_make_up_the_single_rank_global_batch(dp, shuffle):
    single = GlobalBatches(103, indices_as_batch, global_batch_size=8, shuffle=shuffle, seed=5)
    ranks = [GlobalBatches(103, indices_as_batch, 8, dp_size=dp, dp_rank=r, shuffle=shuffle, seed=5) for r in range(dp)]
    for epoch in (0, 1):
        expected = local_batches(single, epoch)
        per_rank = [local_batches(d, epoch) for d in ranks]
        assert len(expected) == 12  # 103 // 8: the incomplete last global batch is dropped
        for k, (x, _) in enumerate(expected):
            assert all(len(batches[k][0]) == 8 // dp for batches in per_rank)
            assert torch.equal(torch.cat([batches[k][0] for batches in per_rank]), x)


def test_epoch_order_is_seeded_randperm():
    data = GlobalBatches(20, indices_as_batch, global_batch_size=5, shuffle=True, seed=7)
    for epoch in (0, 3):
        perm = torch.randperm(20, generator=torch.Generator().manual_seed(7 + epoch))
        assert torch.equal(torch.cat([x for x, _ in local_batches(data, epoch)]), perm)
    assert not torch.equal(data.order(0), data.order(1))
    fixed = GlobalBatches(20, indices_as_batch, global_batch_size=5)
    assert torch.equal(torch.cat([x for x, _ in fixed]), torch.arange(20))


def test_indivisible_global_batch_is_an_error():
    with pytest.raises(ValueError) as error:
        GlobalBatches(100, indices_as_batch, global_batch_size=10, dp_size=4)
    assert str(error.value) == (
        "global_batch_size=10 is not divisible by the data-parallel size 4; choose a multiple of 4"
    )


def test_dp_rank_and_size_from_the_strategy():
    assert dp_rank_and_size(None) == (0, 1)
    assert dp_rank_and_size(SimpleNamespace(strategy=SimpleNamespace())) == (0, 1)
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 3})
    assert dp_rank_and_size(SimpleNamespace(strategy=strategy)) == (3, 4)


def test_datamodule_loader_takes_its_rank_slice():
    data = DigitsDataModule(global_batch_size=8, source="synthetic", synthetic_samples=64)
    data.setup()
    full = [x for x, _ in data.train_dataloader()]
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": 1})
    data.trainer = SimpleNamespace(strategy=strategy, current_epoch=0)
    second_half = [x for x, _ in data.train_dataloader()]
    assert len(full) == len(second_half) > 0
    assert all(torch.equal(a[4:], b) for a, b in zip(full, second_half))
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 3, "rank": 0}))
    with pytest.raises(ValueError, match="global_batch_size=8 is not divisible by the data-parallel size 3"):
        data.train_dataloader()


# ---- text ---------------------------------------------------------------------------------------


def test_text_comes_from_the_stdlib():
    sources = stdlib_sources()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert sources == sorted(sources) and len(sources) > 100
    assert all(p.suffix == ".py" and stdlib in p.parents for p in sources)
    assert not any({"site-packages", "test", "tests"} & set(p.relative_to(stdlib).parts) for p in sources)
    assert stdlib / "os.py" in sources and stdlib / "json" / "decoder.py" in sources

    data = TextDataModule(global_batch_size=4, seq_len=32, max_bytes=100_000)
    data.setup()
    first = sources[0].read_bytes()[:1000]
    assert bytes(data.windows.flatten()[: len(first)].tolist()) == first
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
    assert data.train_samples + data.val_samples == 100_000 // 33


def test_text_windows_shift_by_one_and_validation_is_the_tail(tmp_path):
    text = bytes(range(256)) * 4
    (tmp_path / "a.txt").write_bytes(text)
    data = TextDataModule(global_batch_size=2, seq_len=7, source=str(tmp_path / "*.txt"), val_fraction=0.25)
    data.setup()
    n = len(text) // 8
    assert (data.train_samples, data.val_samples) == (n - n // 4, n // 4)
    for x, y in data.train_dataloader():
        assert torch.equal(x[:, 1:], y[:, :-1])
    x, _ = next(iter(data.val_dataloader()))
    start = data.train_samples * 8
    assert bytes(x[0].tolist()) == text[start : start + 7]


def test_text_source_that_matches_nothing(tmp_path):
    data = TextDataModule(source=str(tmp_path / "nothing-*.txt"))
    with pytest.raises(FileNotFoundError, match="nothing-"):
        data.setup()


# ---- digits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["digits", "synthetic"])
def test_digits(source):
    a, b = DigitsDataModule(source=source), DigitsDataModule(source=source)
    a.setup()
    b.setup()
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert a.images.shape[1:] == (1, 8, 8) and a.images.dtype == torch.float32 and a.labels.dtype == torch.long
    assert set(a.labels.tolist()) == set(range(10))
    if source == "digits":
        assert len(a.labels) == 1797
    x, y = next(iter(a.val_dataloader()))
    assert x.shape == (32, 1, 8, 8) and y.shape == (32,)


# ---- exact resume with a real Trainer -------------------------------------------------------------


class Recorder(L.LightningModule):
    """A linear classifier that records every training batch and loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 10)
        self.seen: list[torch.Tensor] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        self.seen.append(images.clone())
        loss = torch.nn.functional.cross_entropy(self.layer(images.flatten(1)), labels)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(max_steps: int, tmp_path: Path, global_batch_size: int, ckpt_path: str | None = None, save: bool = False):
    L.seed_everything(0)
    data = DigitsDataModule(global_batch_size=global_batch_size, source="synthetic", synthetic_samples=25)
    model = Recorder()
    callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_last=True)] if save else []
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=save,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model


# 20 training samples: global batch 6 gives 3 batches per epoch (step 5 is mid-epoch 1, and 2 samples are
# dropped); global batch 4 gives 5 (step 5 is the last batch of epoch 0). Both resumes cross an epoch boundary.
@pytest.mark.parametrize("global_batch_size", [6, 4])
def test_mid_epoch_resume_continues_exactly(tmp_path, global_batch_size):
    full = _fit(10, tmp_path / "full", global_batch_size)
    assert len(full.seen) == 10
    assert not torch.equal(full.seen[0], full.seen[len(full.seen) // 2])  # epochs are reshuffled

    first = _fit(5, tmp_path / "ckpt", global_batch_size, save=True)
    assert all(torch.equal(a, b) for a, b in zip(first.seen, full.seen[:5]))
    resumed = _fit(10, tmp_path / "resumed", global_batch_size, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert len(resumed.seen) == 5
    for a, b in zip(resumed.seen, full.seen[5:]):
        assert torch.equal(a, b)
    assert resumed.losses == pytest.approx(full.losses[5:], rel=1e-6)
