"""prepare-data (zoo/prepare_data.py) and zoo.TokenDataModule, in one process: what the shards hold, resuming an
interrupted run, bad input, and batches that are layout-independent and the same with DataLoader workers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_mesh.cli import run as lit_mesh
from tests.token_corpus import CORPUS_FILES, EOS, prepare_shards, train_tokenizer
from zoo.prepare_data import PrepareDataError, prepare, token_dtype
from zoo.token_data import TokenDataModule


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def shards(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_shards(tokenizer_dir, tmp_path_factory.mktemp("shards"))


def _tokens(directory: Path, name: str, dtype: str = "uint16") -> np.ndarray:
    return np.fromfile(directory / name, dtype=dtype)


def _encode(tokenizer_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir).encode(text, add_special_tokens=False)


def test_shards_hold_the_documents_then_eos_and_the_tail_is_validation(tokenizer_dir: Path, shards: Path) -> None:
    meta = json.loads((shards / "meta.json").read_text())
    eos = meta["eos_id"]
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 384 and meta["documents"] == len(CORPUS_FILES)
    from transformers import AutoTokenizer

    assert eos == AutoTokenizer.from_pretrained(tokenizer_dir).convert_tokens_to_ids(EOS)
    for index, path in enumerate(sorted(CORPUS_FILES)):
        expected = [*_encode(tokenizer_dir, path.read_text()), eos]
        train, val = _tokens(shards, f"train-{index:05d}.bin"), _tokens(shards, f"val-{index:05d}.bin")
        assert train.tolist() + val.tolist() == expected
        assert len(val) == round(len(expected) * 0.1)
        assert meta["splits"]["train"]["tokens"][index] == len(train)


def test_jsonl_and_parquet_rows_are_documents(tokenizer_dir: Path, tmp_path: Path) -> None:
    rows = [{"body": "def f():\n    return 1\n"}, {"body": "import os\n"}]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pyarrow = pytest.importorskip("pyarrow", reason="parquet needs the [data] extra: pip install 'lit-mesh[data]'")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"body": [r["body"] for r in rows]}), tmp_path / "docs.parquet")
    for name in ("docs.jsonl", "docs.parquet"):
        out = tmp_path / f"out-{name}"
        meta = prepare(
            [str(tmp_path / name)], str(tokenizer_dir), str(out), text_key="body", val_fraction=0.0, progress=False
        )
        expected = [t for r in rows for t in (*_encode(tokenizer_dir, r["body"]), meta["eos_id"])]
        assert _tokens(out, "train-00000.bin").tolist() == expected, name
    with pytest.raises(PrepareDataError, match=r"docs.jsonl:1 has no key 'text' \(keys: \['body'\]\); pass --text-key"):
        prepare([str(tmp_path / "docs.jsonl")], str(tokenizer_dir), str(tmp_path / "x"), progress=False)


def test_an_interrupted_run_resumes_and_parallel_workers_write_the_same(
    tokenizer_dir: Path, shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "resumed"
    files = [str(f) for f in CORPUS_FILES]
    prepare(files, str(tokenizer_dir), str(out), val_fraction=0.1, workers=2, progress=False)
    kept = (out / "train-00000.bin").stat().st_mtime_ns
    # an interruption: part 2 lost its record (it was being written), a half-written shard is left behind
    (out / "part-00002.json").unlink()
    (out / "train-00003.bin.tmp").write_bytes(b"\x01")
    (out / "meta.json").unlink()
    prepare(files, str(tokenizer_dir), str(out), val_fraction=0.1, progress=False)
    assert (out / "train-00000.bin").stat().st_mtime_ns == kept, "a finished part is not tokenised again"
    assert not list(out.glob("*.tmp"))
    for name in sorted(p.name for p in shards.iterdir()):
        assert (out / name).read_bytes() == (shards / name).read_bytes(), name  # 2 workers == 1 worker


def test_bad_input_is_named(tokenizer_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(PrepareDataError, match="input '.*missing.txt' does not exist"):
        prepare([str(tmp_path / "missing.txt")], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(PrepareDataError, match="--tokenizer .*no-tokenizer does not exist"):
        prepare([str(tmp_path / "empty.txt")], str(tmp_path / "no-tokenizer"), str(tmp_path / "o"), progress=False)
    with pytest.raises(PrepareDataError, match="holds no text"):
        prepare([str(tmp_path / "empty.txt")], str(tokenizer_dir), str(tmp_path / "o"), progress=False)
    with pytest.raises(
        PrepareDataError, match="--dtype uint16 holds ids below 65536, but the tokenizer's vocabulary has 128256"
    ):
        token_dtype(128256, "uint16")
    assert token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"


def test_prepare_data_command(tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lit_mesh(
        [
            "prepare-data",
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(tmp_path / "o"),
            "--no-progress",
            str(CORPUS_FILES[0]),
        ]
    )
    assert "wrote" in capsys.readouterr().out and (tmp_path / "o" / "meta.json").is_file()
    with pytest.raises(SystemExit) as exit_code:
        lit_mesh(
            [
                "prepare-data",
                "--tokenizer",
                str(tmp_path / "nope.json"),
                "--out",
                str(tmp_path / "p"),
                str(CORPUS_FILES[0]),
            ]
        )
    assert exit_code.value.code == 2 and "nope.json does not exist" in capsys.readouterr().err


def test_token_batches_are_windows_of_the_stream(shards: Path) -> None:
    data = TokenDataModule(path=str(shards), seq_len=31, global_batch_size=4)
    data.setup()
    stream = np.concatenate([_tokens(shards, f) for f in data.meta["splits"]["train"]["files"]])
    assert data.train_samples == len(stream) // 32
    order = data.train_dataloader().dataset.order(0)
    for k, (x, y) in enumerate(data.train_dataloader()):
        assert x.shape == y.shape == (4, 31) and x.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        start = int(order[4 * k]) * 32
        assert x[0].tolist() == stream[start : start + 31].tolist()
    val = np.concatenate([_tokens(shards, f) for f in data.meta["splits"]["val"]["files"]])
    x, _ = next(iter(data.val_dataloader()))
    assert x[0].tolist() == val[:31].tolist()
    assert all(isinstance(m, np.memmap) for m in data.train_windows.maps.values()), "shards are memory-mapped"


def test_workers_keep_the_batch_order(shards: Path) -> None:
    data = TokenDataModule(path=str(shards), seq_len=15, global_batch_size=4)
    data.setup()
    inline = [x for x, _ in data.train_dataloader()]
    data.num_workers = 3
    with_workers = [x for x, _ in data.train_dataloader()]
    assert len(inline) == len(with_workers) > 3
    assert all(torch.equal(a, b) for a, b in zip(inline, with_workers))


def test_missing_shards_name_the_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="lit-mesh prepare-data --tokenizer TOKENIZER --out"):
        TokenDataModule(path=str(tmp_path))


def test_a_large_text_is_tokenised_in_bounded_batches_with_the_same_tokens(
    tokenizer_dir: Path, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory bounded by a batch, not the file (issue #40): a text file is cut in pieces at newlines before a
    non-space character, which every common pre-tokenizer splits at anyway, so the tokens are unchanged."""
    from zoo import prepare_data

    monkeypatch.setattr(prepare_data, "PIECE_CHARS", 300)
    monkeypatch.setattr(prepare_data, "BATCH_CHARS", 2000)
    index, source = max(enumerate(sorted(CORPUS_FILES)), key=lambda item: item[1].stat().st_size)
    longest_line = max(len(line) for line in source.read_text().splitlines(keepends=True))
    monkeypatch.setattr(prepare_data, "MAX_PIECE_CHARS", 600)
    batches = list(prepare_data._batches(source, "text"))
    assert len(batches) > 5 and all(sum(len(t) for t, _ in b) < 2000 + 600 + longest_line for b in batches)
    monkeypatch.setattr(prepare_data, "MAX_PIECE_CHARS", 10**9)  # clean cuts only: the tokens of the whole text
    out = tmp_path / "pieces"
    prepare([str(source)], str(tokenizer_dir), str(out), val_fraction=0.1, progress=False)
    for split in ("train", "val"):
        assert (out / f"{split}-00000.bin").read_bytes() == (shards / f"{split}-{index:05d}.bin").read_bytes(), split
