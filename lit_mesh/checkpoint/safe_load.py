"""Reading checkpoint files without ever running code from them.

A pickle can name any function for the loader to call. So every file of a checkpoint is read so that only what a
checkpoint holds can come back: DCP's layout file (.metadata) by an unpickler that knows only the classes DCP's
metadata is made of; the non-tensor entries of the shards (and meta.pt, single files) by torch.load's
weights_only=True (tensors and plain values). Anything else is refused by name, before it is called.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import IO, Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lit_mesh.errors import UnsafeCheckpointError

LAYOUT_FILE = ".metadata"  # DCP's name for it

# everything a .metadata written by torch.distributed.checkpoint refers to (torch 2.4-2.13)
_LAYOUT_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # Python 3.13's home
    "collections": {"OrderedDict"},
}


class _LayoutUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _LAYOUT_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):  # a tensor's dtype
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"its layout file {LAYOUT_FILE} refers to {module}.{name}, which no checkpoint layout holds (loading it"
            " could run code): it was not written by torch.distributed.checkpoint, or was altered since"
        )


def read_layout(path: Path) -> Metadata:
    """The layout (.metadata) of the sharded checkpoint directory `path`, read without running code from it."""
    with open(path / LAYOUT_FILE, "rb") as file:
        layout = _LayoutUnpickler(file).load()
    if not isinstance(layout, Metadata):
        raise UnsafeCheckpointError(f"its layout file {LAYOUT_FILE} holds a {type(layout).__name__}, not a layout")
    if layout.storage_meta is None:  # as DCP's reader does
        layout.storage_meta = StorageMeta()
    return layout


def _refusal(error: pickle.UnpicklingError, what: str) -> UnsafeCheckpointError:
    """torch.load's long weights_only message, cut to the name of what it refused."""
    named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if named is None:  # not a refused global: damaged bytes
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return UnsafeCheckpointError(f"{what} cannot be read as tensors and plain values ({first})")
    return UnsafeCheckpointError(
        f"{what} holds a pickled {named.group(1)}, which loading would run; a checkpoint holds tensors and plain"
        " values only, so it was not loaded (it was written by other code, or altered since)"
    )


def load_weights_only(source: str | Path | IO[bytes], what: str) -> Any:
    """torch.load of tensors and plain values only; anything else raises UnsafeCheckpointError naming `what`."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise _refusal(error, what) from None


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the layout read by read_layout (tensors it reads with weights_only=True itself)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        layout = read_layout(Path(self.path))
        assert layout.storage_meta is not None  # set by read_layout
        layout.storage_meta.load_id = self.load_id
        return layout


class _WeightsOnlyBytes(DefaultLoadPlanner):
    """The non-tensor entries of the shards through load_weights_only (DCP's own planner unpickles them whole)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        loaded = load_weights_only(value, f"the entry {key!r} of its shards")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], loaded)
        else:
            self.state_dict[key] = loaded


class SafeLoadPlanner(_WeightsOnlyBytes):
    """DCP's default load planner, byte entries loaded safely."""


class _SafeFullLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the layout (as dcp_to_torch_save does), byte entries loaded safely."""


def _raised_inside(error: CheckpointException) -> Optional[UnsafeCheckpointError]:
    # DCP wraps each rank's exception (with its traceback) in one CheckpointException for every rank
    for cause, _ in error.failures.values():
        if isinstance(cause, UnsafeCheckpointError):
            return cause
    return None


def safe_dcp_load(state: dict[str, Any], path: Path) -> None:
    """dcp.load into `state` (collective when a process group exists), never running code from the files."""
    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
    except CheckpointException as error:
        unsafe = _raised_inside(error)
        if unsafe is None:
            raise
        raise UnsafeCheckpointError(str(unsafe)) from None


def read_entries(path: Path, keys: Optional[set[str]] = None) -> dict[str, Any]:
    """The entries of a sharded checkpoint (all, or `keys` by their flattened names), unsharded, on this process
    alone (no process group), never running code from the files."""
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=SafeReader(path), planner=_SafeFullLoadPlanner(keys=keys), no_dist=True)
    except CheckpointException as error:
        unsafe = _raised_inside(error)
        if unsafe is None:
            raise
        raise UnsafeCheckpointError(str(unsafe)) from None
    return state
