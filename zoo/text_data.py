"""Byte-level language-modelling data (vocabulary 256): by default the Python standard library's source."""

from __future__ import annotations

import functools
import glob
import os
import sysconfig
from pathlib import Path

import torch

from zoo.global_batches import Batch, GlobalBatchDataModule

# directories left out of the default corpus: installed packages, and the (large) test suites
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files (top level and packages), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]  # prune before descending
        paths += [Path(directory, f) for f in files if f.endswith(".py")]
    return sorted(paths)


def text_sources(source: str | None) -> list[Path]:
    """The files behind `source`: None (the stdlib), a directory (its files, recursively) or a glob."""
    if source is None:
        return stdlib_sources()
    path = Path(source).expanduser()
    if path.is_dir():
        paths = [p for p in path.rglob("*") if p.is_file()]
    else:
        paths = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    if not paths:
        raise FileNotFoundError(f"TextDataModule: no text files found at source={source!r}")
    return sorted(paths)


@functools.lru_cache(maxsize=4)
def load_bytes(source: str | None, max_bytes: int) -> torch.Tensor:
    """The sources concatenated in sorted order, truncated to max_bytes, as uint8. Cached per process."""
    chunks, total = [], 0
    for path in text_sources(source):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class TextDataModule(GlobalBatchDataModule):
    """Next-byte prediction on non-overlapping windows of seq_len + 1 bytes.

    Batches are (inputs, targets): LongTensors (B, seq_len), targets shifted by one. The last
    val_fraction of the windows are validation (also test; predict uses their inputs).
    """

    def __init__(
        self,
        global_batch_size: int = 8,
        seq_len: int = 128,
        source: str | None = None,
        max_bytes: int = 2_000_000,
        val_fraction: float = 0.02,
        seed: int = 0,
    ) -> None:
        super().__init__(global_batch_size, seed)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.source = source
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.windows: torch.Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.windows is not None:
            return
        data = load_bytes(self.source, self.max_bytes)
        n_windows = len(data) // (self.seq_len + 1)
        if n_windows < 2:
            raise ValueError(
                f"TextDataModule: {len(data)} bytes make {n_windows} windows of seq_len + 1 = {self.seq_len + 1};"
                " raise max_bytes or lower seq_len"
            )
        self.windows = data[: n_windows * (self.seq_len + 1)].view(n_windows, self.seq_len + 1)
        self.val_samples = int(n_windows * self.val_fraction)
        self.train_samples = n_windows - self.val_samples

    def make_train_batch(self, indices: torch.Tensor) -> Batch:
        return self._batch(indices)

    def make_val_batch(self, indices: torch.Tensor) -> Batch:
        return self._batch(indices + self.train_samples)

    def _batch(self, window_indices: torch.Tensor) -> Batch:
        assert self.windows is not None, "call setup() first"
        # index_select, not windows[indices]: advanced indexing of a large uint8 tensor dispatches a parallel kernel
        # that costs ms per batch where the host's threads are busy (benchmarks/recipe_host_profile.py)
        x = self.windows.index_select(0, window_indices).long()
        return x[:, :-1], x[:, 1:]
