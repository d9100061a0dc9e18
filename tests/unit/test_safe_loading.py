"""Loading a checkpoint never runs code from it (issue #40, item 1): a crafted layout (.metadata), a crafted
non-tensor entry in a shard, a crafted meta.pt and a crafted sibling are refused by name through every
single-process entry point, and no payload runs; a damaged shard is refused by its checksum. (fit/validate
--ckpt_path on 2 ranks: tests/integration/test_checkpoint_errors.py.)"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lit_mesh.checkpoint import CheckpointError, export_full_state_dict, load_sharded_checkpoint
from lit_mesh.checkpoint.safe_load import read_layout
from tests.evil_checkpoints import POISONS, corrupt_shard, model_and_optimizer, poison_layout
from tests.evil_checkpoints import sound_checkpoint as write_checkpoint


def _load_sharded(checkpoint: Path, out: Path) -> Any:
    model, optimizer = model_and_optimizer()
    wrapped = nn.Module()
    wrapped.model = model
    return load_sharded_checkpoint(checkpoint, wrapped, {"optimizer_0": optimizer})


def _cli(argv: list[str]) -> Callable[[Path, Path], Any]:
    def call(checkpoint: Path, out: Path) -> Any:
        from lit_mesh.cli import run

        return run([argv[0], str(checkpoint), str(out), *argv[1:]])

    return call


def _export_hf(checkpoint: Path, out: Path) -> Any:
    from zoo.convert.export import export_hf

    return export_hf(checkpoint, out)


ENTRY_POINTS: dict[str, Callable[[Path, Path], Any]] = {
    "load_sharded_checkpoint": _load_sharded,
    "export_full_state_dict": lambda checkpoint, out: export_full_state_dict(checkpoint, out),
    "lit-mesh export": _cli(["export"]),
    "export_hf": _export_hf,
    "lit-mesh export-hf": _cli(["export-hf"]),
}


def _refusal(call: Callable[[], Any], capsys: pytest.CaptureFixture[str]) -> str:
    """The message a refused call gave: the exception's, or the command's one line (exit status 1)."""
    try:
        call()
    except CheckpointError as error:
        return str(error)
    except SystemExit as exit_:
        assert exit_.code == 1, exit_.code
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") == 1, err
        return err
    raise AssertionError("the checkpoint was loaded")


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("poison", ["layout", "entry"])
def test_a_crafted_checkpoint_is_refused_by_name_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], poison: str, entry: str
) -> None:
    checkpoint = write_checkpoint(tmp_path / "step=1.ckpt")
    marker, out = tmp_path / "payload-ran", tmp_path / "out"
    POISONS[poison](checkpoint, marker)
    message = _refusal(lambda: ENTRY_POINTS[entry](checkpoint, out), capsys)
    assert f"cannot load checkpoint {str(checkpoint)!r}" in message, message
    expected = "refers to builtins.exec" if poison == "layout" else "optimizer_0.param_groups.0.amsgrad"
    assert expected in message and "exec" in message, message
    assert not marker.exists(), "the payload ran"
    assert not out.exists(), "nothing is written for a refused checkpoint"


@pytest.mark.parametrize("entry", ["load_sharded_checkpoint", "export_hf"])
def test_a_crafted_meta_pt_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str) -> None:
    checkpoint = write_checkpoint(tmp_path / "step=1.ckpt")
    marker = tmp_path / "payload-ran"
    POISONS["meta"](checkpoint, marker)
    message = _refusal(lambda: ENTRY_POINTS[entry](checkpoint, tmp_path / "out"), capsys)
    assert "meta.pt" in message and "holds a pickled exec, which loading would run" in message, message
    assert not marker.exists()


def test_the_layout_reader_knows_only_what_dcp_writes(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "ok.ckpt")
    layout = read_layout(checkpoint)  # a real layout: its classes, torch.Size, dtypes, the layout enum
    assert "state_dict.model.0.weight" in layout.state_dict_metadata
    poison_layout(checkpoint, tmp_path / "ran")
    with pytest.raises(CheckpointError, match=r"refers to builtins\.exec, which no checkpoint layout holds"):
        read_layout(checkpoint)
    assert not (tmp_path / "ran").exists()


def test_a_single_file_checkpoint_with_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.evil_checkpoints import Payload

    marker, checkpoint = tmp_path / "ran", tmp_path / "one.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "callbacks": Payload(marker)}, checkpoint)
    message = _refusal(lambda: ENTRY_POINTS["lit-mesh export"](checkpoint, tmp_path / "out.pt"), capsys)
    assert "holds a pickled exec" in message and not marker.exists(), message


def test_a_damaged_shard_is_refused_by_its_checksum(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "step=1.ckpt")
    export_full_state_dict(checkpoint, tmp_path / "before.pt")  # sound: it exports
    shard = corrupt_shard(checkpoint)
    with pytest.raises(CheckpointError, match=rf"{shard} differs from the file that was saved"):
        export_full_state_dict(checkpoint, tmp_path / "after.pt")
    assert not (tmp_path / "after.pt").exists()


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_crafted_and_damaged_siblings_are_read_safely_and_never_recommended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: str
) -> None:
    runs = tmp_path / "checkpoints"
    checkpoints = [write_checkpoint(runs / f"step={i}.ckpt") for i in range(1, 5)]
    for age, checkpoint in enumerate(checkpoints):  # step=1 oldest ... step=4 newest
        os.utime(checkpoint / "meta.pt", (1_000_000 + age, 1_000_000 + age))
    good, poisoned_layout, poisoned_entry, refused = checkpoints
    marker = tmp_path / "ran"
    POISONS["layout"](poisoned_layout, marker)
    POISONS["entry"](poisoned_entry, marker)
    corrupt_shard(refused)
    message = _refusal(lambda: ENTRY_POINTS[entry](refused, tmp_path / "out"), capsys)
    assert "differs from the file that was saved" in message, message
    assert f"previous complete checkpoint, {str(good)!r}" in message, message
    assert not marker.exists(), "a sibling's payload ran"


def test_the_load_planner_itself_loads_entries_as_plain_values(tmp_path: Path) -> None:
    """Behind verify_checkpoint, dcp loads through our planner: a crafted entry is refused there too."""
    from lit_mesh.checkpoint.safe_load import safe_dcp_load
    from lit_mesh.errors import UnsafeCheckpointError

    checkpoint = write_checkpoint(tmp_path / "step=1.ckpt")
    marker = tmp_path / "ran"
    key = POISONS["entry"](checkpoint, marker)
    state: dict[str, Any] = {key: None}
    with pytest.raises(UnsafeCheckpointError, match=rf"the entry {key!r} of its shards holds a pickled exec"):
        safe_dcp_load(state, checkpoint)
    assert not marker.exists()
