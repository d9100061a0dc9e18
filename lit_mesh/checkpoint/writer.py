"""CheckpointWriter: how MeshStrategy writes and reads sharded checkpoints.

Saves are atomic: every rank writes into NAME.partial, and NAME appears (replacing an older NAME) only once all
have finished, so a crash mid-save leaves the previous checkpoint (e.g. last.ckpt) untouched and loadable.
Asynchronous saves copy the state in memory and write it in a background thread (lit_mesh/checkpoint/async_save.py).
Gradient-compression state (per-rank residuals) is written beside the shards (lit_mesh/comm/state.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn

from lit_mesh.checkpoint.async_save import AsyncCheckpointSaver, split_for_dcp, write_metadata
from lit_mesh.checkpoint.checksums import write_checksums
from lit_mesh.checkpoint.files import failed_save_reported, load_sharded_checkpoint, publish_checkpoint
from lit_mesh.comm.compression import CompressionRun
from lit_mesh.comm.state import load_compression_state, save_compression_state
from lit_mesh.unit import Rule, option


@dataclass(frozen=True)
class CheckpointOptions:
    distributed: bool = option(
        True,
        doc="sharded checkpoints (a directory, one file per rank) or one full file.",
        arg="save_distributed_checkpoint",
    )
    asynchronous: bool = option(
        False,
        doc="write sharded checkpoints in a background thread (training goes on once the state is copied in memory);"
        " the directory appears under its name only when every rank has written it.",
        arg="async_save",
    )


RULES: list[Rule] = [
    Rule(
        "async_save_needs_sharded",
        "init",
        lambda f: f.options.checkpoint.asynchronous and not f.options.checkpoint.distributed,
        lambda f: "async_save=True writes sharded checkpoints: keep save_distributed_checkpoint=True",
        ValueError,
    ),
]


class CheckpointWriter:
    """One per strategy. `connect` once the processes exist; then `save`, `load` and `wait` from the hooks."""

    def __init__(self, asynchronous: bool) -> None:
        self._saver = AsyncCheckpointSaver() if asynchronous else None
        self._rank, self._world_size = 0, 1
        self._barrier: Callable[[], None] = lambda: None

    def connect(
        self, rank: int, world_size: int, barrier: Callable[[], None], timeout: Optional[timedelta] = None
    ) -> None:
        """Collective (every rank): an asynchronous writer gets its own process group, with the run's timeout."""
        self._rank, self._world_size, self._barrier = rank, world_size, barrier
        if self._saver is not None:
            self._saver.setup(timeout)

    def save(
        self,
        checkpoint: dict[str, Any],
        path: Path,
        write: Callable[[dict[str, Any], Path], None],
        compression: Optional[CompressionRun],
        layout: str,
        finish_now: bool,
    ) -> None:
        """Write `checkpoint` to `path` (every rank the same path). `write(checkpoint, directory)` writes the shards
        synchronously (Lightning's sharded save); `finish_now`: an asynchronous save is waited for (no teardown
        will wait for it)."""
        partial = path.with_name(path.name + ".partial")
        self.wait()  # the previous save may still write this partial directory
        if self._rank == 0 and partial.exists():
            shutil.rmtree(partial)  # left by an earlier crash
        self._barrier()
        if compression is not None:  # per-rank residuals, beside the shards
            save_compression_state(compression, partial, self._rank, self._world_size, layout)
        if self._saver is not None:
            state = split_for_dcp(checkpoint)
            if self._rank == 0:
                write_metadata(checkpoint, partial, _METADATA_FILENAME)
            self._saver.save(state, partial, path, coordinator=self._rank == 0)
            if finish_now:
                self.wait()
            return
        with failed_save_reported(partial, path):  # disk full: the partial copy goes, the message names what is intact
            write(checkpoint, partial)
        self._barrier()  # every shard and the metadata are on disk
        if self._rank == 0:
            write_checksums(partial)  # verified before every load: a damaged shard is refused, not loaded
            publish_checkpoint(partial, path)
        self._barrier()

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizers: dict[str, torch.optim.Optimizer],
        strict: bool,
        compression: Optional[CompressionRun],
        layout: str,
        aliases: Optional[dict[str, str]] = None,
    ) -> dict[str, Any]:
        """Load a sharded checkpoint into the model and optimizers as they are sharded now (any mesh); `aliases`:
        see load_sharded_checkpoint."""
        self.wait()
        loaded = load_sharded_checkpoint(path, model, optimizers, strict=strict, aliases=aliases)
        if compression is not None:
            load_compression_state(compression, path, self._rank, self._world_size, layout)
        return loaded

    def wait(self) -> None:
        """Block until an asynchronous save in flight is on disk under its name (no-op otherwise)."""
        if self._saver is not None:
            self._saver.wait()
