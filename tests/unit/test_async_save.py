"""AsyncCheckpointSaver in one process: the state is copied before save() returns, and the directory is
published under its name only once written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lit_mesh.checkpoint.async_save import AsyncCheckpointSaver


def test_saved_state_is_the_state_at_save_time(tmp_path: Path) -> None:
    weight = torch.arange(1_000_000, dtype=torch.float32)
    saver = AsyncCheckpointSaver()
    staging, path = tmp_path / "last.ckpt.partial", tmp_path / "last.ckpt"
    saver.save({"state_dict": {"w": weight}}, staging, path, coordinator=True)
    weight.mul_(-1)  # training goes on: the next optimizer step changes the weights in place
    saver.wait()
    assert path.is_dir() and not staging.exists()
    loaded = {"state_dict": {"w": torch.empty_like(weight)}}
    dcp.load(loaded, checkpoint_id=path)
    torch.testing.assert_close(loaded["state_dict"]["w"], torch.arange(1_000_000, dtype=torch.float32), rtol=0, atol=0)


def test_a_failed_write_is_raised_in_the_training_thread(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    saver = AsyncCheckpointSaver()
    saver.save({"state_dict": {"w": torch.ones(4)}}, blocker / "x.partial", blocker / "x", coordinator=True)
    with pytest.raises(RuntimeError, match="asynchronous checkpoint save failed"):
        saver.wait()
    saver.wait()  # reported once; nothing in flight any more
