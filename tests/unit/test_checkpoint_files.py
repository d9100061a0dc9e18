"""Checkpoint directories that cannot be loaded are refused with the path and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from lit_mesh.checkpoint import export_full_state_dict, load_sharded_checkpoint


def test_partial_checkpoint_without_metadata_is_refused(tmp_path: Path) -> None:
    partial = tmp_path / "step=5.ckpt"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"")  # shards written, metadata never reached
    with pytest.raises(FileNotFoundError, match=r"step=5.ckpt.*has no meta.pt: it is partial"):
        load_sharded_checkpoint(partial, nn.Linear(2, 2), {})


def test_export_refuses_a_file_that_is_not_a_lightning_checkpoint(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="holds no 'state_dict' entry"):
        export_full_state_dict(path, tmp_path / "out.pt")


class Payload:
    """Stands for arbitrary code a malicious checkpoint could make pickle run."""


def test_loading_never_unpickles_code(tmp_path: Path) -> None:
    import torch

    from lit_mesh.errors import UnsafeCheckpointError

    checkpoint = tmp_path / "evil.ckpt"
    checkpoint.mkdir()
    torch.save({"epoch": 0, "payload": Payload()}, checkpoint / "meta.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"its meta.pt holds a pickled .*Payload, which loading would run"):
        load_sharded_checkpoint(checkpoint, nn.Linear(2, 2), {})


def test_a_checkpoint_of_another_model_shape_is_named(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "small.ckpt"
    dcp.save({"state_dict": nn.Linear(4, 3).state_dict()}, checkpoint_id=checkpoint, no_dist=True)
    torch.save({"epoch": 0}, checkpoint / "meta.pt")
    with pytest.raises(ValueError, match=r"weight: \(3, 4\) in the checkpoint, \(5, 4\) in this model"):
        load_sharded_checkpoint(checkpoint, nn.Linear(4, 5), {})
