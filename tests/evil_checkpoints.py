"""Checkpoints crafted to run code when loaded the unsafe way (issue #40), damaged ones, and a sound one to start
from. The payload is harmless: it creates a marker file, so a test sees whether any loader ran it."""

from __future__ import annotations

import builtins
import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def sound_checkpoint(path: Path) -> Path:
    """A sharded checkpoint as MeshStrategy writes it (nested optimizer state: learning rates etc. as non-tensor
    entries), hyper-parameters in meta.pt, with checksums."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from lit_mesh.checkpoint import NESTED_OPTIMIZER_STATE_OPTIONS
    from lit_mesh.checkpoint.checksums import write_checksums

    model, optimizer = model_and_optimizer()
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=NESTED_OPTIMIZER_STATE_OPTIONS)
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "optimizer_0": optimizer_state}
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({"epoch": 0, "hyper_parameters": {"architecture": "llama"}}, path / "meta.pt")
    write_checksums(path)
    return path


class Payload:
    """Unpickled, it calls builtins.exec on code that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


def _layout(checkpoint: Path):  # noqa: ANN202 - DCP's Metadata; our own file, read the plain way
    with open(checkpoint / ".metadata", "rb") as file:
        return pickle.load(file)  # noqa: S301 - a layout this test suite wrote


def _rechecksummed(checkpoint: Path) -> None:
    """As an attacker would: the checksums made to match the altered files (so the safe readers must refuse)."""
    from lit_mesh.checkpoint.checksums import CHECKSUM_FILE, write_checksums

    if (checkpoint / CHECKSUM_FILE).is_file():
        write_checksums(checkpoint)


def poison_layout(checkpoint: Path, marker: Path) -> None:
    """The layout file (.metadata) replaced by a pickle that runs the payload."""
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def poison_entry(checkpoint: Path, marker: Path) -> str:
    """A real layout whose first non-tensor entry now points at a torch.save of the payload, appended to its
    shard; returns the entry's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    layout = _layout(checkpoint)
    key = next(k for k, v in sorted(layout.state_dict_metadata.items()) if isinstance(v, BytesStorageMetadata))
    index = MetadataIndex(key)
    info = layout.storage_data[index]
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    shard = checkpoint / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as file:
        file.write(payload.getvalue())
    layout.storage_data[index] = type(info)(info.relative_path, offset, len(payload.getvalue()))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(layout))
    _rechecksummed(checkpoint)
    return key


def poison_meta(checkpoint: Path, marker: Path) -> None:
    """Lightning's meta.pt (loops, callbacks, hyper-parameters) with the payload among its entries."""
    torch.save({"epoch": 0, "hyper_parameters": {"x": Payload(marker)}}, checkpoint / "meta.pt")
    _rechecksummed(checkpoint)


def corrupt_shard(checkpoint: Path) -> str:
    """4 KB of 0xff written over the middle of the largest shard (its size unchanged); returns its name."""
    shard = max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    start = max(0, len(data) // 2 - 2048)
    data[start : start + 4096] = b"\xff" * len(data[start : start + 4096])
    shard.write_bytes(bytes(data))
    return shard.name


POISONS = {"layout": poison_layout, "entry": poison_entry, "meta": poison_meta}
# what the refusal names: the function the pickle would have called
REFUSED_NAME = {"layout": "builtins.exec", "entry": "exec", "meta": "exec"}
