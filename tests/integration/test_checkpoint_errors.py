"""Damaged checkpoints are refused with one message naming the checkpoint, what is wrong and the previous complete
checkpoint, and nothing in the directory changes (issue #25, item 6). One launch on 2 ranks probes them all."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.launch import REPO, launch

COMMON = [
    "--trainer.devices=2",
    "--trainer.strategy.init_args.dp=2",
    "--trainer.logger=CSVLogger",
    "--data.global_batch_size=4",
    "--seed_everything=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
]


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, object]:
    out = tmp_path_factory.mktemp("ckpt_errors")
    gpt = ["-c", str(REPO / "configs/gpt.yaml"), *COMMON]
    moe = ["-c", str(REPO / "configs/moe.yaml"), *COMMON]
    proc = launch(2, "checkpoint_probes.py", str(out), json.dumps(gpt), json.dumps(moe), timeout=400)
    assert (out / "probes.json").is_file(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, json.loads((out / "probes.json").read_text()), proc


@pytest.mark.parametrize(
    ("probe", "what"),
    [
        ("missing_shard", "shard file(s) __1_0.distcp of the 2 its layout lists are missing"),
        ("truncated_shard", "truncated shard file(s): __0_0.distcp holds"),
        ("unreadable_layout", "its layout file .metadata cannot be read"),
        ("gpt_into_moe", "it holds the weights of another model"),
        # issue #40: crafted to run code (fit and validate --ckpt_path), or damaged inside a shard
        ("evil_layout", "its layout file .metadata refers to builtins.exec"),
        ("evil_entry", "holds a pickled exec, which loading would run"),
        ("validate_evil_entry", "holds a pickled exec, which loading would run"),
        ("validate_evil_layout", "its layout file .metadata refers to builtins.exec"),
        ("corrupt_shard", "differs from the file that was saved"),
    ],
)
def test_a_damaged_checkpoint_is_named_with_the_previous_one(probes: tuple, probe: str, what: str) -> None:
    out, results, _ = probes
    result = results[probe]
    directory = out / {"gpt_into_moe": "ckpt"}.get(probe, probe.removeprefix("validate_"))
    message = result["resume"]
    assert re.match(r"(Unsafe)?CheckpointError: cannot load checkpoint", message), message
    assert str(directory / "step=4.ckpt") in message and what in message, message
    assert f"previous complete checkpoint, '{directory / 'step=2.ckpt'}'" in message, message
    assert result["unchanged"], "the checkpoint directory must be left as it was"
    if "export" in result:  # lit-mesh export / export_hf read through the same check
        assert re.match(r"(Unsafe)?CheckpointError: cannot load checkpoint", result["export"]), result["export"]
        assert what in result["export"], result["export"]


def test_a_sibling_crafted_to_run_code_is_read_safely_and_never_recommended(probes: tuple) -> None:
    out, results, _ = probes
    message = results["evil_sibling"]["resume"]
    assert message.startswith("CheckpointError: cannot load checkpoint"), message
    assert f"there is no other complete checkpoint in '{out / 'evil_sibling'}'" in message, message
    assert not results["payload_ran"], "a payload ran in fit, validate or export"


def test_the_console_reports_once_and_exits_1(probes: tuple) -> None:
    _, _, proc = probes
    assert proc.returncode != 0
    report = proc.stdout + proc.stderr
    assert report.count("lit-mesh: cannot load checkpoint") == 1, report[-4000:]
    # no rank's traceback (torchrun's agent prints its own, of ChildFailedError, after every failed launch)
    assert "CheckpointError" not in report and "lit_mesh/checkpoint/" not in report, report[-4000:]


def test_a_failed_save_leaves_the_previous_checkpoints_and_says_so(probes: tuple) -> None:
    out, results, _ = probes
    result = results["disk_full"]
    assert result["save"].startswith(f"OSError: saving checkpoint '{out / 'full_disk' / 'step=4.ckpt'}' failed"), result
    assert (
        "No space left on device" in result["save"]
        and "the previous checkpoints are intact: step=2.ckpt" in result["save"]
    )
    assert result["left"] == ["step=2.ckpt"], "no partial directory, the earlier checkpoint untouched"


def test_retention_never_deletes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    import os

    from lit_mesh.checkpoint import remove_checkpoint

    for age, name in enumerate(["step=2.ckpt", "step=4.ckpt"]):
        (tmp_path / name).mkdir()
        for file in ("meta.pt", ".metadata"):
            (tmp_path / name / file).write_bytes(b"x")
            os.utime(tmp_path / name / file, (1000 + age, 1000 + age))
    (tmp_path / "step=6.ckpt.partial").mkdir()  # an interrupted save is not "newest complete"
    remove_checkpoint(tmp_path / "step=4.ckpt")
    assert (tmp_path / "step=4.ckpt").is_dir(), "the newest complete checkpoint is kept"
    remove_checkpoint(tmp_path / "step=2.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=4.ckpt", "step=6.ckpt.partial"]
