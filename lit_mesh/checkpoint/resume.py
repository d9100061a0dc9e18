"""Resume by itself: the newest complete checkpoint of a run, for `ckpt_path="last"` after a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import lightning as L
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.callbacks import ModelCheckpoint


def is_complete_checkpoint(path: Path) -> bool:
    """Whether `path` is a complete, published checkpoint.

    A published checkpoint: a single file, or a sharded directory with its metadata (an interrupted save
    leaves NAME.partial without it; publish_checkpoint's NAME.old is on its way out).
    """
    if path.suffix != ".ckpt":
        return False
    if path.is_dir():
        return (path / _METADATA_FILENAME).is_file() and (path / ".metadata").is_file()
    return path.is_file()


def complete_checkpoints(directory: Union[str, Path]) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first (by when their metadata was written)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if is_complete_checkpoint(p)]

    def written(p: Path) -> float:
        return (p / _METADATA_FILENAME if p.is_dir() else p).stat().st_mtime

    return sorted(found, key=lambda p: (written(p), p.name))


def newest_checkpoint(where: Union[L.Trainer, str, Path]) -> Optional[Path]:
    """The newest complete checkpoint in a directory or a Trainer's checkpoint dirpaths.

    The newest complete checkpoint (`last*.ckpt` or `step=*.ckpt` alike, never a `.partial`) in a directory,
    or in the dirpaths of a Trainer's ModelCheckpoint callbacks; None when there is none yet.
    """
    if isinstance(where, L.Trainer):
        dirs = [Path(c.dirpath) for c in where.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    else:
        dirs = [Path(where)]
    candidates = [p for d in dirs for p in complete_checkpoints(d)]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (p / _METADATA_FILENAME if p.is_dir() else p).stat().st_mtime)


def resolve_ckpt_path(trainer: L.Trainer, ckpt_path: Optional[str]) -> Optional[str]:
    """Resolve `ckpt_path="last"` to the newest complete checkpoint.

    `ckpt_path="last"` -> the newest complete checkpoint of the trainer's ModelCheckpoint dirpaths (Lightning's
    own "last" knows only `last*.ckpt` and starts from scratch without one); Lightning's answer otherwise.
    """
    if ckpt_path != "last":
        return ckpt_path
    newest = newest_checkpoint(trainer)
    return str(newest) if newest is not None else ckpt_path
