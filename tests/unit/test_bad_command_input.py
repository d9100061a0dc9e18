"""Bad input to `lit-mesh prepare-data`, `export` and `export-hf` gets one message naming the value (and the fix),
an exit status that is not 0, no traceback, and nothing the user had is changed (issue #40, item 3). Each case
runs the command in this process, as `lit-mesh` would."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lit_mesh.cli import run as lit_mesh
from tests.evil_checkpoints import sound_checkpoint
from tests.token_corpus import train_tokenizer


@dataclass(frozen=True)
class Given:
    tmp: Path
    tokenizer: Path  # a transformers tokenizer directory (tokenizer.json inside)
    text: Path  # a good input file
    ckpt_file: Path  # a single-file Lightning checkpoint
    ckpt_dir: Path  # a sharded checkpoint

    def write(self, name: str, data: str | bytes) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def given(tmp_path: Path, tokenizer: Path) -> Given:
    text = tmp_path / "in" / "doc.txt"
    text.parent.mkdir()
    text.write_text("def f():\n    return 1\n")
    ckpt_file = tmp_path / "one.ckpt"
    torch.save({"state_dict": {"model.w": torch.ones(2)}, "hyper_parameters": {}}, ckpt_file)
    return Given(tmp_path, tokenizer, text, ckpt_file, sound_checkpoint(tmp_path / "sharded.ckpt"))


def prep(g: Given, *inputs: str | Path, out: str | Path | None = None, tok: str | Path | None = None) -> list:
    return [
        "prepare-data",
        "--no-progress",
        "--tokenizer",
        str(tok or g.tokenizer),
        "--out",
        str(out or g.tmp / "out"),
        *map(str, inputs or [g.text]),
    ]


def jsonl(g: Given, line: str | bytes) -> Path:
    return g.write("rows.jsonl", (line.encode() if isinstance(line, str) else line) + b"\n")


# name -> (the command's arguments, given the files; what the message must name)
CASES: dict[str, tuple[Callable[[Given], list], str]] = {
    # prepare-data (26)
    "prep: no input": (lambda g: ["prepare-data", "--tokenizer", str(g.tokenizer), "--out", "o"], "INPUT"),
    "prep: missing input": (lambda g: prep(g, g.tmp / "nope.txt"), "nope.txt' does not exist"),
    "prep: glob matching nothing": (lambda g: prep(g, g.tmp / "*.none"), "*.none' does not exist"),
    "prep: missing tokenizer": (lambda g: prep(g, tok=g.tmp / "tok.json"), "--tokenizer"),
    "prep: tokenizer file not JSON": (lambda g: prep(g, tok=g.write("t.json", "{oops")), "is no tokenizer.json"),
    "prep: tokenizer JSON of another kind": (lambda g: prep(g, tok=g.write("t.json", '{"a": 1}')), "t.json is no"),
    "prep: tokenizer directory without one": (
        lambda g: prep(g, tok=_directory(g, "empty-dir")),
        "cannot load a tokenizer from this directory",
    ),
    "prep: unknown --eos-token": (lambda g: prep(g) + ["--eos-token", "<nope>"], "tried ['<nope>']"),
    "prep: --val-fraction 1.5": (lambda g: prep(g) + ["--val-fraction", "1.5"], "--val-fraction 1.5 must be"),
    "prep: --val-fraction -0.1": (lambda g: prep(g) + ["--val-fraction", "-0.1"], "--val-fraction -0.1 must be"),
    "prep: --val-fraction not a number": (lambda g: prep(g) + ["--val-fraction", "x"], "invalid float value: 'x'"),
    "prep: --workers 0": (lambda g: prep(g) + ["--workers", "0"], "--workers 0 must be at least 1"),
    "prep: --dtype unknown": (lambda g: prep(g) + ["--dtype", "int8"], "invalid choice: 'int8'"),
    "prep: --out is a file": (lambda g: prep(g, out=g.write("o.txt", "keep")), "o.txt' is a file"),
    "prep: --out inside an input directory": (
        lambda g: prep(g, g.text.parent, out=g.text.parent / "shards"),
        "is inside the input directory",
    ),
    "prep: --out is the input directory": (lambda g: prep(g, g.text.parent, out=g.text.parent), "inside the input"),
    "prep: JSONL line not JSON": (lambda g: prep(g, jsonl(g, "{'text': 1")), "rows.jsonl:1 is not JSON"),
    "prep: JSONL row without the key": (lambda g: prep(g, jsonl(g, '{"body": "x"}')), "rows.jsonl:1 has no key"),
    "prep: JSONL text null": (lambda g: prep(g, jsonl(g, '{"text": null}')), "rows.jsonl:1: its 'text' is null"),
    "prep: JSONL text a number": (lambda g: prep(g, jsonl(g, '{"text": 5}')), "its 'text' is int, not text"),
    "prep: JSONL row not an object": (lambda g: prep(g, jsonl(g, "[1, 2]")), "rows.jsonl:1 is a JSON list"),
    "prep: JSONL not UTF-8": (lambda g: prep(g, jsonl(g, b'{"text": "\xff"}')), "rows.jsonl:1 is not UTF-8"),
    "prep: text not UTF-8": (lambda g: prep(g, g.write("latin.txt", b"caf\xe9\n")), "latin.txt:1 is not UTF-8"),
    "prep: binary input": (lambda g: prep(g, g.write("blob.bin", b"\x00\x01\x02" * 10)), "blob.bin:1 holds NUL"),
    "prep: no text at all": (lambda g: prep(g, g.write("blank.txt", "\n  \n")), "holds no text"),
    "prep: JSONL second line bad": (
        lambda g: prep(g, g.write("two.jsonl", '{"text": "a"}\n{"text": \n')),
        "two.jsonl:2 is not JSON",
    ),
    # export (13)
    "export: missing checkpoint": (lambda g: ["export", str(g.tmp / "no.ckpt"), str(g.tmp / "o.pt")], "no.ckpt"),
    "export: text file as checkpoint": (
        lambda g: ["export", str(g.write("notes.txt", "hello")), str(g.tmp / "o.pt")],
        "cannot be read",
    ),
    "export: empty file as checkpoint": (
        lambda g: ["export", str(g.write("empty.ckpt", b"")), str(g.tmp / "o.pt")],
        "empty.ckpt",
    ),
    "export: truncated checkpoint file": (
        lambda g: ["export", str(g.write("cut.ckpt", g.ckpt_file.read_bytes()[:200])), str(g.tmp / "o.pt")],
        "cut.ckpt",
    ),
    "export: no state_dict": (
        lambda g: ["export", str(_saved(g, "bare.pt", {"w": torch.ones(1)})), str(g.tmp / "o.pt")],
        "holds no 'state_dict' entry",
    ),
    "export: directory that is no checkpoint": (
        lambda g: ["export", str(g.text.parent), str(g.tmp / "o.pt")],
        "has no .metadata",
    ),
    "export: output exists": (lambda g: ["export", str(g.ckpt_file), str(g.write("o.pt", "mine"))], "o.pt' exists"),
    "export: output is the checkpoint": (
        lambda g: ["export", str(g.ckpt_file), str(g.ckpt_file)],
        "is the checkpoint itself",
    ),
    "export: output is a directory": (lambda g: ["export", str(g.ckpt_file), str(g.text.parent)], "is a directory"),
    "export: output inside the checkpoint": (
        lambda g: ["export", str(g.ckpt_dir), str(g.ckpt_dir / "w.pt")],
        "is inside the checkpoint",
    ),
    "export: output under a file": (
        lambda g: ["export", str(g.ckpt_file), str(g.write("f", "x") / "o.pt")],
        "is a file",
    ),
    "export: bad --prefix": (
        lambda g: ["export", str(g.ckpt_dir), str(g.tmp / "o.pt"), "--prefix", "nope"],
        "no weights under prefix 'nope'",
    ),
    "export: output a directory, --force": (
        lambda g: ["export", str(g.ckpt_file), str(g.text.parent), "--force"],
        "is a directory",
    ),
    # export-hf (9)
    "export-hf: missing checkpoint": (lambda g: ["export-hf", str(g.tmp / "no.ckpt"), str(g.tmp / "hf")], "no.ckpt"),
    "export-hf: text file as checkpoint": (
        lambda g: ["export-hf", str(g.write("notes.txt", "hello")), str(g.tmp / "hf")],
        "cannot be read",
    ),
    "export-hf: output is a file": (
        lambda g: ["export-hf", str(g.ckpt_dir), str(g.write("hf.txt", "keep"))],
        "hf.txt' is a file",
    ),
    "export-hf: output exists": (
        lambda g: ["export-hf", str(g.ckpt_dir), str(g.write("hf/model.safetensors", "x").parent)],
        "hf' exists; name another output, or pass --force",
    ),
    "export-hf: output is the checkpoint": (
        lambda g: ["export-hf", str(g.ckpt_dir), str(g.ckpt_dir)],
        "is the checkpoint itself",
    ),
    "export-hf: no meta.pt": (lambda g: ["export-hf", str(_without_meta(g)), str(g.tmp / "hf")], "has no meta.pt"),
    "export-hf: bad --prefix": (
        lambda g: ["export-hf", str(g.ckpt_dir), str(g.tmp / "hf"), "--prefix", "nope"],
        "no weights under prefix 'nope'",
    ),
    "export-hf: unknown architecture": (
        lambda g: ["export-hf", str(_hparams(g, {"architecture": "nope"})), str(g.tmp / "hf")],
        "architecture='nope' is none of",
    ),
    "export-hf: neither zoo nor zoo.hf": (
        lambda g: ["export-hf", str(_hparams(g, {})), str(g.tmp / "hf")],
        "neither a zoo model nor a zoo.hf module",
    ),
}


def _saved(g: Given, name: str, state: dict) -> Path:
    torch.save(state, g.tmp / name)
    return g.tmp / name


def _directory(g: Given, name: str) -> Path:
    (g.tmp / name).mkdir()
    return g.tmp / name


def _without_meta(g: Given) -> Path:
    """Written by torch.distributed.checkpoint alone: no meta.pt, no checksums."""
    from lit_mesh.checkpoint.checksums import CHECKSUM_FILE

    (g.ckpt_dir / "meta.pt").unlink()
    (g.ckpt_dir / CHECKSUM_FILE).unlink()
    return g.ckpt_dir


def _hparams(g: Given, hparams: dict) -> Path:
    from lit_mesh.checkpoint.checksums import write_checksums

    torch.save({"epoch": 0, "hyper_parameters": hparams}, g.ckpt_dir / "meta.pt")
    write_checksums(g.ckpt_dir)
    return g.ckpt_dir


def _fingerprint(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha1(f.read_bytes()).hexdigest() for f in root.rglob("*") if f.is_file()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_message_and_changes_nothing(
    given: Given, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments, named = CASES[case]
    argv = arguments(given)  # may write the bad input itself
    before = _fingerprint(given.tmp)
    with pytest.raises(SystemExit) as exit_:
        lit_mesh(argv)
    err = capsys.readouterr().err
    assert exit_.value.code not in (0, None), err
    assert "Traceback" not in err and named in err, err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1, err  # one message (after usage)
    after = _fingerprint(given.tmp)
    assert {k: v for k, v in after.items() if k in before} == before, "a file the user had was changed"
    assert not [k for k in after if k not in before and k.endswith((".tmp", ".pt", ".safetensors"))], after


def test_the_counts_of_the_issue_are_covered() -> None:
    kinds = [case.split(":")[0] for case in CASES]
    assert (kinds.count("prep"), kinds.count("export"), kinds.count("export-hf")) >= (24, 12, 8)


def test_prepare_data_removes_only_its_own_temporary_files(given: Given) -> None:
    from zoo.prepare_data import prepare

    out = given.tmp / "shards"
    out.mkdir()
    mine, theirs = out / "train-00000.bin.tmp", out / "notes.tmp"
    mine.write_bytes(b"\x01")
    theirs.write_text("the user's")
    prepare([str(given.text)], str(given.tokenizer), str(out), progress=False)
    assert not mine.exists() and theirs.read_text() == "the user's"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 1


def test_a_tokenizer_directory_with_custom_code_never_runs_it(given: Given, monkeypatch: pytest.MonkeyPatch) -> None:
    """trust_remote_code=False: no "run the custom code? [y/N]" prompt, no import of the directory's module."""
    import shutil

    from zoo.prepare_data import PrepareDataError, prepare

    marker = given.tmp / "tokenizer-code-ran"
    directory = given.tmp / "custom-tokenizer"
    shutil.copytree(given.tokenizer, directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["custom.CustomTokenizer", "custom.CustomTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\nCustomTokenizer = None\n")
    monkeypatch.setattr("builtins.input", lambda *_: pytest.fail("prepare-data asked whether to run the code"))
    try:
        prepare([str(given.text)], str(directory), str(given.tmp / "out"), progress=False)
    except PrepareDataError as error:
        assert "custom-tokenizer" in str(error)
    assert not marker.exists(), "the tokenizer directory's code ran"


def test_the_cli_keeps_a_config_yaml_it_did_not_write(tmp_path: Path) -> None:
    from lit_mesh.cli import free_config_name

    assert free_config_name(str(tmp_path), "config.yaml", "a: 1\n") == "config.yaml"  # nothing there
    (tmp_path / "config.yaml").write_text("mine: true\n")
    assert free_config_name(str(tmp_path), "config.yaml", "a: 1\n") == "config-1.yaml"
    (tmp_path / "config-1.yaml").write_text("a: 1\n")  # this run's own, from before a restart
    assert free_config_name(str(tmp_path), "config.yaml", "a: 1\n") == "config-1.yaml"
    assert free_config_name(str(tmp_path), "config.yaml", "a: 2\n") == "config-2.yaml"
    (tmp_path / "config.yaml").write_text("a: 3\n")
    assert free_config_name(str(tmp_path), "config.yaml", "a: 3\n") == "config.yaml"
