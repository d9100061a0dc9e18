"""Language-modelling batches from token shards written by `lit-mesh prepare-data` (zoo/prepare_data.py).

Each split's shards are one token stream (in input order), cut into non-overlapping windows of seq_len + 1
tokens; sample i is window i. Shards are memory-mapped and a batch reads only its windows, so a process never
holds the corpus in RAM. The order of the samples, the dp slices and the exact resume are GlobalBatchDataModule's,
as for TextDataModule: the global batches do not depend on the mesh layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from typing_extensions import override

from zoo.global_batches import Batch, GlobalBatchDataModule
from zoo.prepare_data import DTYPES, FORMAT_VERSION, META_FILE


class TokenWindows:
    """Windows of `width` tokens over the concatenation of memory-mapped shard files."""

    def __init__(self, directory: Path, files: list[str], tokens: list[int], dtype: str, width: int) -> None:
        self.paths = [directory / f for f, n in zip(files, tokens) if n > 0]
        self.starts = np.cumsum([0] + [n for n in tokens if n > 0])  # token offset of each shard in the stream
        self.dtype = DTYPES[dtype]
        self.width = width
        self.maps: dict[int, np.memmap] = {}  # opened on first use (in each DataLoader worker)

    def __len__(self) -> int:
        return int(self.starts[-1]) // self.width

    def _shard(self, index: int) -> np.memmap:
        if index not in self.maps:
            self.maps[index] = np.memmap(self.paths[index], dtype=self.dtype, mode="r")
        return self.maps[index]

    def window(self, sample: int) -> np.ndarray:
        """Tokens [sample * width, (sample + 1) * width) of the stream; a window may span shards."""
        lo, hi = sample * self.width, (sample + 1) * self.width
        out = np.empty(self.width, dtype=np.int64)
        shard = int(np.searchsorted(self.starts, lo, side="right")) - 1
        filled = 0
        while filled < self.width:
            begin = lo + filled - int(self.starts[shard])
            take = min(hi - lo - filled, int(self.starts[shard + 1]) - (lo + filled))
            out[filled : filled + take] = self._shard(shard)[begin : begin + take]
            filled += take
            shard += 1
        return out

    def __call__(self, samples: torch.Tensor) -> Batch:
        x = torch.from_numpy(np.stack([self.window(int(s)) for s in samples]))
        return x[:, :-1], x[:, 1:]


def read_meta(path: str | Path) -> dict:
    """The `meta.json` of a directory written by `lit-mesh prepare-data`."""
    meta_file = Path(path).expanduser() / META_FILE
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"TokenDataModule: {str(meta_file)!r} does not exist; write the shards first:"
            f" lit-mesh prepare-data --tokenizer TOKENIZER --out {path} INPUT..."
        )
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{str(meta_file)!r} has format {meta.get('format')}, this version reads {FORMAT_VERSION};"
            " prepare the data again"
        )
    return meta


class TokenDataModule(GlobalBatchDataModule):
    """Next-token prediction on token shards; batches are (inputs, targets), LongTensors (B, seq_len).

    path:        the directory `lit-mesh prepare-data --out` wrote
    num_workers: DataLoader worker processes (0: load in the training process); batches keep their order
    """

    def __init__(
        self, path: str, seq_len: int = 128, global_batch_size: int = 8, seed: int = 0, num_workers: int = 0
    ) -> None:
        super().__init__(global_batch_size, seed, num_workers)
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be at least 1")
        self.save_hyperparameters()
        self.path = Path(path).expanduser()
        self.seq_len = seq_len
        self.meta = read_meta(self.path)  # a missing directory fails at construction, before any rank starts
        self.vocab_size: int = self.meta["vocab_size"]
        self.train_windows: TokenWindows | None = None
        self.val_windows: TokenWindows | None = None

    def _windows(self, split: str) -> TokenWindows:
        shards = self.meta["splits"][split]
        return TokenWindows(self.path, shards["files"], shards["tokens"], self.meta["dtype"], self.seq_len + 1)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.train_windows is not None:
            return
        self.train_windows, self.val_windows = self._windows("train"), self._windows("val")
        self.train_samples, self.val_samples = len(self.train_windows), len(self.val_windows)
        if self.train_samples == 0:
            raise ValueError(
                f"TokenDataModule: {sum(self.meta['splits']['train']['tokens'])} training tokens in {str(self.path)!r}"
                f" make no window of seq_len + 1 = {self.seq_len + 1}; lower seq_len or prepare more text"
            )

    @override
    def make_train_batch(self, indices: torch.Tensor) -> Batch:
        assert self.train_windows is not None, "call setup() first"
        return self.train_windows(indices)

    @override
    def make_val_batch(self, indices: torch.Tensor) -> Batch:
        assert self.val_windows is not None, "call setup() first"
        return self.val_windows(indices)
