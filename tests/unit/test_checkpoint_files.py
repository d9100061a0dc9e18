"""Checkpoint directories that cannot be loaded are refused with the path and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from lit_mesh.checkpoint import export_full_state_dict, load_sharded_checkpoint
from lit_mesh.errors import CheckpointError


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


class TiedModel(nn.Module):
    """An embedding and an output head sharing one matrix (tied embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


class LastStage(nn.Module):
    """What a pipeline's last stage keeps of TiedModel: the head, its own copy of the matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 8, bias=False)


def test_a_pipeline_stage_copy_of_a_tied_matrix_loads_the_whole_models_optimizer_state(tmp_path: Path) -> None:
    """A checkpoint saved without pp holds the tied matrix's AdamW state once, under the embedding's name; the last
    stage's head copy takes it through `aliases` (without them the load names the missing entry)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    whole = TiedModel()
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    whole.head(whole.emb(torch.tensor([1, 2, 3]))).square().sum().backward()
    optimizer.step()
    checkpoint = tmp_path / "tied.ckpt"
    state = {"state_dict": get_model_state_dict(whole), "optimizer_0": get_optimizer_state_dict(whole, optimizer)}
    dcp.save(state, checkpoint_id=checkpoint, no_dist=True)
    torch.save({"epoch": 0}, checkpoint / "meta.pt")

    stage = LastStage()
    stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="it has no entry for .* optimizer_0.state.head.weight"):
        load_sharded_checkpoint(checkpoint, stage, {"optimizer_0": stage_optimizer})
    load_sharded_checkpoint(checkpoint, stage, {"optimizer_0": stage_optimizer}, aliases={"head.weight": "emb.weight"})
    assert torch.equal(stage.head.weight, whole.emb.weight)
    saved, loaded = optimizer.state[whole.emb.weight], stage_optimizer.state[stage.head.weight]
    assert saved.keys() == loaded.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key


class Grown(nn.Module):
    """A model with one tensor more than the one its checkpoint was saved from."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 3)
        self.extra = nn.Linear(3, 1)


def test_without_strict_loading_the_models_other_tensors_keep_their_values(tmp_path: Path) -> None:
    """strict_loading=False (Lightning's LightningModule flag, passed as strict): the tensors the checkpoint holds are
    loaded, the model's others keep theirs; strict (the default) refuses naming them, before touching the model."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.manual_seed(0)
    saved = nn.Module()
    saved.body = nn.Linear(3, 3)
    checkpoint = tmp_path / "small.ckpt"
    dcp.save({"state_dict": get_model_state_dict(saved)}, checkpoint_id=checkpoint, no_dist=True)
    torch.save({"epoch": 0}, checkpoint / "meta.pt")
    grown = Grown()
    extra, body = grown.extra.weight.detach().clone(), grown.body.weight.detach().clone()
    with pytest.raises(
        CheckpointError, match="2 of this model's 4 tensors are not in it .e.g. extra.weight, extra.bias"
    ):
        load_sharded_checkpoint(checkpoint, grown, {})
    assert torch.equal(grown.body.weight, body)
    load_sharded_checkpoint(checkpoint, grown, {}, strict=False)
    assert torch.equal(grown.body.weight, saved.body.weight) and torch.equal(grown.extra.weight, extra)
