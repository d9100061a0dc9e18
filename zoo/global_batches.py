"""Global batches that do not depend on the mesh layout, and the DataModule base that serves them.

The promise: the same config gives the same sequence of GLOBAL batches whatever the number of data-parallel
ranks; each dp rank takes a contiguous slice of every global batch. Lightning would replace a map-style
loader's sampler with a shuffling DistributedSampler, so we yield ready-made local batches from an
IterableDataset and choose the order ourselves:

    epoch e order:   torch.randperm(n_samples, generator=Generator().manual_seed(seed + e))  (or 0..n-1)
    global batch k:  order[k*G:(k+1)*G]; an incomplete last global batch is dropped
    dp rank r:       rows [r*G/dp, (r+1)*G/dp) of it

Tensor-parallel (and CP/PP) ranks of one replica share a dp rank, so they see the same batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

Batch = tuple[torch.Tensor, torch.Tensor]

# Lightning warns about IterableDatasets with __len__ because several workers could duplicate data; ours
# never do (worker w yields global batches w, w + W, ...; see GlobalBatches.__iter__), and __len__ is exact.
warnings.filterwarnings("ignore", message=r".*Your `IterableDataset` has `__len__` defined.*")
# Lightning only knows resumable *loaders*; ours resume through the DataModule's state_dict (below)
warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable.*")


def check_divisible(global_batch_size: int, dp_size: int) -> None:
    if global_batch_size % dp_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the data-parallel size {dp_size};"
            f" choose a multiple of {dp_size}"
        )


def global_batch_splits(trainer: L.Trainer | None) -> int:
    """Micro-batches per global batch: 1, or the data-parallel ranks a replanned run lost, as a factor
    (MeshStrategy(on_world_change="replan"), lit_mesh/reliability/replan.py); Lightning accumulates them into one step."""
    return int(getattr(getattr(trainer, "strategy", None), "global_batch_splits", 1))


def dp_rank_and_size(trainer: L.Trainer | None) -> tuple[int, int]:
    """(dp_rank, dp_size) from the strategy's sampler arguments; (0, 1) without a distributed strategy."""
    if trainer is None:
        return 0, 1
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))


class GlobalBatches(IterableDataset):
    """Yields this dp rank's slice of every global batch of one epoch.

    make_batch:  maps a 1-D LongTensor of sample indices to a batch `(inputs, targets)`.
    shuffle:     a seeded permutation per epoch (training) or the fixed order 0..n-1 (evaluation).
    start:       called at the start of each pass; returns (epoch, global batches to skip). Defaults to
                 (self.epoch, 0); the DataModule uses it to follow the trainer's epoch and to resume.
    splits:      each rank's slice of a global batch is yielded as this many micro-batches, in row order.
    """

    def __init__(
        self,
        n_samples: int,
        make_batch: Callable[[torch.Tensor], Batch],
        global_batch_size: int,
        dp_size: int = 1,
        dp_rank: int = 0,
        shuffle: bool = False,
        seed: int = 0,
        start: Callable[[], tuple[int, int]] | None = None,
        splits: int = 1,
    ) -> None:
        check_divisible(global_batch_size, dp_size * splits)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside the data-parallel size {dp_size}")
        self.n_samples = n_samples
        self.make_batch = make_batch
        self.global_batch_size = global_batch_size
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.shuffle = shuffle
        self.seed = seed
        self.start = start
        self.splits = splits
        self.epoch = 0
        self._position: tuple[int, int] | None = None  # (epoch, batches to skip), fixed by begin()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        """Batches per epoch: the same on every rank and for every dp size."""
        return self.n_samples // self.global_batch_size * self.splits

    def order(self, epoch: int) -> torch.Tensor:
        if self.shuffle:
            return torch.randperm(self.n_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        return torch.arange(self.n_samples)

    def global_indices(self, epoch: int) -> list[torch.Tensor]:
        """The sample indices of every global batch of `epoch` (what a single rank would see)."""
        G = self.global_batch_size
        order = self.order(epoch)
        return [order[k * G : (k + 1) * G] for k in range(self.n_samples // G)]

    def begin(self) -> None:
        """Fix where the next pass starts. The loader calls it in the main process before DataLoader workers
        copy the dataset: `start` moves the DataModule's resume position, which a worker's copy could not."""
        self._position = self.start() if self.start is not None else (self.epoch, 0)

    def __iter__(self) -> Iterator[Batch]:
        if self._position is None:
            self.begin()
        assert self._position is not None
        (epoch, skip), self._position = self._position, None
        local = self.global_batch_size // self.dp_size
        micro = local // self.splits
        starts = range(self.dp_rank * local, (self.dp_rank + 1) * local, micro)
        batches = [indices[lo : lo + micro] for indices in self.global_indices(epoch)[skip:] for lo in starts]
        worker = get_worker_info()
        if worker is not None:  # the DataLoader takes one batch from each worker in turn: the order is kept
            batches = batches[worker.id :: worker.num_workers]
        for indices in batches:
            yield self.make_batch(indices)


class GlobalBatchLoader(DataLoader):
    """A DataLoader over GlobalBatches that fixes the start of each pass before its workers start."""

    def __iter__(self) -> Any:
        self.dataset.begin()
        return super().__iter__()


class GlobalBatchDataModule(L.LightningDataModule):
    """Serves `GlobalBatches` for fit/validate/test/predict and makes mid-epoch resume exact.

    Subclasses implement `setup()` to fill `self.train_samples` / `self.val_samples` (sample counts) and
    `make_train_batch` / `make_val_batch`. Validation data also serves test and predict.
    """

    splits_global_batches = (
        True  # can serve each training global batch as micro-batches (lit_mesh/reliability/replan.py)
    )

    def __init__(self, global_batch_size: int, seed: int, num_workers: int = 0) -> None:
        super().__init__()
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be at least 1")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be 0 (load in the training process) or more")
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.train_samples = 0
        self.val_samples = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches already processed) from a checkpoint

    def make_train_batch(self, indices: torch.Tensor) -> Batch:
        raise NotImplementedError

    def make_val_batch(self, indices: torch.Tensor) -> Batch:
        raise NotImplementedError

    # -- where the training loop stands ------------------------------------------------------------
    def _current_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def _train_start(self) -> tuple[int, int]:
        # the first pass after a checkpoint load continues where the checkpoint was taken (once only)
        if self._resume is not None:
            start, self._resume = self._resume, None
            return start
        return self._current_epoch(), 0

    def state_dict(self) -> dict[str, Any]:
        """The training position, saved into every checkpoint.

        Checkpoints are written from on_train_batch_end, on_validation_end or on_train_epoch_end; at all
        three, `batch_progress.current.processed` counts the batches of this epoch whose training step
        ran (including the current one). Counting yielded batches would be one too many: Lightning's
        fetcher prefetches one batch ahead.
        """
        trainer = self.trainer
        if trainer is None:
            return {}
        epoch = trainer.current_epoch
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        if processed >= trainer.num_training_batches:  # the epoch is finished: resume at the next one
            epoch, processed = epoch + 1, 0
        # in global batches, whatever micro-batches they were served as: a relaunch may split them otherwise
        return {"epoch": epoch, "batches_processed": processed // global_batch_splits(trainer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._resume = (int(state_dict["epoch"]), int(state_dict["batches_processed"]))

    def teardown(self, stage: str) -> None:
        # a position restored by validate/test (or left unused) must not leak into a later fit
        self._resume = None

    # -- loaders -----------------------------------------------------------------------------------
    def _loader(self, n_samples: int, make_batch: Callable[[torch.Tensor], Batch], train: bool) -> DataLoader:
        dp_rank, dp_size = dp_rank_and_size(self.trainer)
        dataset = GlobalBatches(
            n_samples,
            make_batch,
            self.global_batch_size,
            dp_size=dp_size,
            dp_rank=dp_rank,
            shuffle=train,
            seed=self.seed,
            start=self._train_start if train else None,
            splits=global_batch_splits(self.trainer) if train else 1,
        )
        if len(dataset) == 0:
            warnings.warn(
                f"{type(self).__name__}: {n_samples} samples make no complete global batch of"
                f" {self.global_batch_size}; lower global_batch_size",
                stacklevel=2,
            )
        # batch_size=None: the dataset yields finished batches; the order is ours, not a sampler's
        device = getattr(getattr(self.trainer, "strategy", None), "root_device", None)
        pin_memory = device is not None and device.type == "cuda"  # page-locked host batches copy asynchronously
        return GlobalBatchLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=pin_memory)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_samples, self.make_train_batch, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_samples, self.make_val_batch, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_samples, self.make_val_batch, train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_samples, self.make_val_batch, train=False)
