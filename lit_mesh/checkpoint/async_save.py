"""Asynchronous sharded checkpoints: copy the state in memory, write it in a background thread, publish it
atomically once every rank has written. Training continues while the files are written."""

from __future__ import annotations

from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lit_mesh.checkpoint.checksums import write_checksums
from lit_mesh.checkpoint.files import publish_checkpoint


class AsyncCheckpointSaver:
    """One save in flight at a time. `save` returns once the state is copied in memory; the write runs
    in a thread and, on the coordinator (rank 0), renames the finished directory into place."""

    def __init__(self) -> None:
        self._group: Optional[dist.ProcessGroup] = None
        self._pending: Optional[Future] = None

    def setup(self, timeout: Optional[timedelta] = None) -> None:
        """Collective (every rank): the background thread gets its own gloo group, so its collectives never
        interleave with training's on the default group (DCP needs a CPU backend for async saves anyway); it
        carries the run's timeout (None: torch's default)."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def save(self, state: dict[str, Any], partial: Path, path: Path, coordinator: bool) -> None:
        self.wait()
        # a Future: an AsyncSaveResponse comes only with an async_stager's staging future
        written = cast(Future, dcp.async_save(state, checkpoint_id=partial, process_group=self._group))
        if not coordinator:
            self._pending = written
            return
        # DCP's coordinator finishes last (it writes the metadata after gathering every rank's write results),
        # so its future done means every shard is on disk. A future of our own completes after the rename.
        published: Future = Future()
        written.add_done_callback(lambda done: _publish(done, partial, path, published))
        self._pending = published

    def wait(self) -> None:
        """Block until the save in flight is written and published; raise what went wrong with it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as error:
            raise RuntimeError(f"asynchronous checkpoint save failed: {error}") from error

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()


def _publish(written: Future, partial: Path, path: Path, published: Future) -> None:
    try:
        written.result()
        write_checksums(partial)  # every rank's shards are on disk (see save)
        publish_checkpoint(partial, path)
    except BaseException as error:  # handed to the training thread by wait()
        published.set_exception(error)
    else:
        published.set_result(None)


def split_for_dcp(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Split Lightning's checkpoint dict like ModelParallelStrategy does: tensors for DCP, the rest for rank 0's
    metadata file (pops them from `checkpoint`)."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    return state


def write_metadata(checkpoint: dict[str, Any], directory: Path, filename: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, directory / filename)
