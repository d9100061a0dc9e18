"""`lit-mesh prepare-data`: tokenise a corpus into memory-mapped token shards that zoo.TokenDataModule reads.

Output directory:
    meta.json              tokenizer, vocab size, EOS id, dtype, and per split the shard files and token counts
    train-NNNNN.bin        one flat array of token ids (uint16 or uint32) per input file, documents ended by EOS
    val-NNNNN.bin          the last --val-fraction of that input's tokens (a cut as nanoGPT's, may split a document)
    part-NNNNN.json        written last for each input: the record that its shards are complete

Inputs are tokenised in parallel, one input file per task. A re-run skips inputs whose part record matches (same
file size and mtime, same settings), so an interrupted run resumes; shards are written under a temporary name
and renamed, so a killed run never leaves a truncated shard behind a record. meta.json is written last.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lit_mesh.extras import require

META_FILE = "meta.json"
FORMAT_VERSION = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# EOS tokens tried, in order, when a bare tokenizer.json does not say which one ends a document
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")
_JSONL = (".jsonl", ".ndjson")
_PARQUET = (".parquet",)


class PrepareDataError(ValueError):
    """Bad input to prepare-data, naming the value and the fix."""


# ---- tokenizer ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerInfo:
    path: str
    vocab_size: int
    eos_id: int


def load_tokenizer(path: str) -> Any:
    """A `tokenizers.Tokenizer`: from a tokenizer.json file, or the fast tokenizer of a local transformers
    directory (AutoTokenizer, no download)."""
    source = Path(path).expanduser()
    if source.is_file():
        return require("tokenizers").Tokenizer.from_file(str(source))
    if source.is_dir():
        AutoTokenizer = require("transformers").AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        if not getattr(tokenizer, "is_fast", False):
            raise PrepareDataError(
                f"--tokenizer {path}: {type(tokenizer).__name__} is not a fast tokenizer; save a"
                " tokenizer.json (tokenizers) for it"
            )
        return tokenizer.backend_tokenizer
    raise PrepareDataError(
        f"--tokenizer {path} does not exist; give a tokenizer.json file or a local directory that"
        " transformers' AutoTokenizer loads (save one with tokenizer.save_pretrained(DIR))"
    )


def tokenizer_info(path: str, eos_token: str | None) -> TokenizerInfo:
    tokenizer = load_tokenizer(path)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    candidates = [eos_token] if eos_token else [*_configured_eos(path), *_EOS_CANDIDATES]
    for token in candidates:
        eos_id = tokenizer.token_to_id(token)
        if eos_id is not None:
            return TokenizerInfo(str(Path(path).expanduser().resolve()), vocab_size, eos_id)
    raise PrepareDataError(
        f"--tokenizer {path}: no end-of-document token found (tried {candidates}); name it with --eos-token TOKEN"
    )


def _configured_eos(path: str) -> list[str]:
    """The EOS token a transformers directory names in tokenizer_config.json, if any."""
    config = Path(path).expanduser() / "tokenizer_config.json"
    if not config.is_file():
        return []
    eos = json.loads(config.read_text()).get("eos_token")
    return [eos["content"] if isinstance(eos, dict) else eos] if eos else []


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    """uint16 where every id fits, else uint32; a requested dtype too small for the vocabulary is an error."""
    if requested == "auto":
        return "uint16" if vocab_size <= 2**16 else "uint32"
    if requested not in DTYPES:
        raise PrepareDataError(f"--dtype {requested}: choose auto, uint16 or uint32")
    limit = np.iinfo(DTYPES[requested]).max + 1
    if vocab_size > limit:
        raise PrepareDataError(
            f"--dtype {requested} holds ids below {limit}, but the tokenizer's vocabulary has {vocab_size} tokens;"
            " use --dtype uint32 (or auto)"
        )
    return requested


# ---- inputs ---------------------------------------------------------------------------------------------------


def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    """Files named, found under directories (recursively) or matched by globs; sorted, each once."""
    if not inputs:
        raise PrepareDataError("no INPUT given; name text, JSONL or parquet files (or directories, or globs)")
    found: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file())
        else:
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise PrepareDataError(f"input {item!r} does not exist (no file, directory or glob match)")
            found += matches
    return sorted({p.resolve() for p in found})


def documents(path: Path, text_key: str) -> Iterator[str]:
    """The documents of one input: a text file is one document; JSONL and parquet give one per row."""
    if path.suffix in _JSONL:
        with open(path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    yield _text_of(json.loads(line), text_key, f"{path}:{line_number}")
    elif path.suffix in _PARQUET:
        for row_number, row in enumerate(_parquet_rows(path)):
            yield _text_of(row, text_key, f"{path} row {row_number}")
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def _text_of(row: dict[str, Any], text_key: str, where: str) -> str:
    if text_key not in row:
        raise PrepareDataError(f"{where} has no key {text_key!r} (keys: {sorted(row)[:8]}); pass --text-key KEY")
    return str(row[text_key])


def _parquet_rows(path: Path) -> Any:
    try:
        from datasets import load_dataset
    except ImportError as error:
        raise PrepareDataError(
            f"{path}: reading parquet needs HF datasets; install it with: pip install 'lit-mesh[data]'"
        ) from error
    return load_dataset("parquet", data_files=str(path), split="train")  # a local file, no download


# ---- one input -> its shards ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    tokenizer: str
    eos_id: int
    dtype: str
    text_key: str
    val_fraction: float


def _record_of(path: Path, settings: Settings) -> dict[str, Any]:
    stat = path.stat()
    return {"source": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, **asdict(settings)}


def _shard_names(index: int) -> tuple[str, str, str]:
    return f"train-{index:05d}.bin", f"val-{index:05d}.bin", f"part-{index:05d}.json"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


_TOKENIZER: Any = None  # one per worker process, loaded once


def _tokenize_part(task: tuple[int, str, str, Settings]) -> dict[str, Any]:
    """Tokenise input `index` and write its shards and then its part record; returns the record."""
    global _TOKENIZER
    index, source, out_dir, settings = task
    if _TOKENIZER is None:
        _TOKENIZER = load_tokenizer(settings.tokenizer)
    path, out = Path(source), Path(out_dir)
    texts = [text for text in documents(path, settings.text_key) if text.strip()]  # an empty document adds no EOS
    chunks = [
        np.asarray(e.ids + [settings.eos_id], dtype=DTYPES[settings.dtype])
        for e in _TOKENIZER.encode_batch(texts, add_special_tokens=False)
    ]
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=DTYPES[settings.dtype])
    n_val = int(round(len(tokens) * settings.val_fraction))
    train_name, val_name, part_name = _shard_names(index)
    _write_atomic(out / train_name, tokens[: len(tokens) - n_val].tobytes())
    _write_atomic(out / val_name, tokens[len(tokens) - n_val :].tobytes())
    record = {
        **_record_of(path, settings),
        "train_tokens": len(tokens) - n_val,
        "val_tokens": n_val,
        "documents": len(chunks),
    }
    _write_atomic(out / part_name, json.dumps(record).encode())  # last: the part is complete
    return record


def _done_record(out: Path, index: int, path: Path, settings: Settings) -> dict[str, Any] | None:
    """The part's record when an earlier run finished this very input with these settings, else None."""
    train_name, val_name, part_name = _shard_names(index)
    try:
        record = json.loads((out / part_name).read_text())
    except (OSError, ValueError):
        return None
    same = all(record.get(k) == v for k, v in _record_of(path, settings).items())
    itemsize = np.dtype(settings.dtype).itemsize
    sizes = {train_name: record.get("train_tokens", -1) * itemsize, val_name: record.get("val_tokens", -1) * itemsize}
    complete = all((out / name).is_file() and (out / name).stat().st_size == size for name, size in sizes.items())
    return record if same and complete else None


# ---- the whole corpus -----------------------------------------------------------------------------------------


def prepare(
    inputs: Sequence[str],
    tokenizer: str,
    out: str,
    text_key: str = "text",
    val_fraction: float = 0.01,
    workers: int = 1,
    dtype: str = "auto",
    eos_token: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise `inputs` into shards under `out` and write meta.json; returns the metadata."""
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareDataError(f"--val-fraction {val_fraction} must be in [0, 1)")
    if workers < 1:
        raise PrepareDataError(f"--workers {workers} must be at least 1")
    paths = expand_inputs(inputs)  # bad paths fail before anything is written
    info = tokenizer_info(tokenizer, eos_token)
    settings = Settings(info.path, info.eos_id, token_dtype(info.vocab_size, dtype), text_key, val_fraction)
    out_dir = Path(out).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*.tmp"):  # left by an interrupted run
        stale.unlink()
    records: dict[int, dict[str, Any]] = {}
    todo = []
    for index, path in enumerate(paths):
        done = _done_record(out_dir, index, path, settings)
        if done is not None:
            records[index] = done
        else:
            todo.append((index, str(path), str(out_dir), settings))
    for index, record in _run(todo, workers, progress, already=len(records), total=len(paths)):
        records[index] = record
    ordered = [records[i] for i in range(len(paths))]
    train_tokens = sum(r["train_tokens"] for r in ordered)
    if train_tokens == 0:
        raise PrepareDataError(f"the corpus {list(inputs)} holds no text: every input tokenised to nothing")
    meta = {
        "format": FORMAT_VERSION,
        "tokenizer": info.path,
        "vocab_size": info.vocab_size,
        "eos_id": info.eos_id,
        "dtype": settings.dtype,
        "text_key": text_key,
        "val_fraction": val_fraction,
        "documents": sum(r["documents"] for r in ordered),
        "splits": {
            split: {
                "files": [_shard_names(i)[k] for i in range(len(paths))],
                "tokens": [r[f"{split}_tokens"] for r in ordered],
            }
            for k, split in enumerate(("train", "val"))
        },
    }
    _write_atomic(out_dir / META_FILE, json.dumps(meta, indent=1).encode())
    return meta


def _run(todo: list, workers: int, progress: bool, already: int, total: int) -> Iterator[tuple[int, dict]]:
    from tqdm import tqdm

    bar = tqdm(total=total, initial=already, unit="file", desc="tokenising", disable=not progress)
    if workers == 1 or len(todo) <= 1:
        results: Iterator = map(_tokenize_part, todo)
        pool = None
    else:  # processes, not threads: the Python side of tokenising holds the GIL
        pool = ProcessPoolExecutor(max_workers=workers)
        results = pool.map(_tokenize_part, todo, chunksize=max(1, len(todo) // (workers * 8)))
    try:
        for task, record in zip(todo, results):
            bar.update(1)
            yield task[0], record
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lit-mesh prepare-data",
        description="Tokenise text, JSONL or parquet files into memory-mapped token shards for zoo.TokenDataModule."
        " Re-running the same command resumes an interrupted run.",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files (one document each), .jsonl"
        " (one document per line) or .parquet files (one per row); directories and globs too",
    )
    parser.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a local transformers directory")
    parser.add_argument("--out", required=True, help="the output directory (meta.json and the .bin shards)")
    parser.add_argument("--text-key", default="text", help="the field holding the text in JSONL/parquet rows")
    parser.add_argument("--val-fraction", type=float, default=0.01, help="the tail of each input kept for validation")
    parser.add_argument("--workers", type=int, default=1, help="processes tokenising files in parallel")
    parser.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"], help="token storage")
    parser.add_argument("--eos-token", default=None, help="the token ending each document (default: the tokenizer's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        meta = prepare(
            args.inputs,
            args.tokenizer,
            args.out,
            args.text_key,
            args.val_fraction,
            args.workers,
            args.dtype,
            args.eos_token,
            progress=not args.no_progress,
        )
    except PrepareDataError as error:
        parser.exit(2, f"lit-mesh prepare-data: error: {error}\n")
    tokens = {split: sum(s["tokens"]) for split, s in meta["splits"].items()}
    print(
        f"wrote {args.out}: {tokens['train']} train and {tokens['val']} validation tokens ({meta['dtype']},"
        f" {meta['documents']} documents, vocabulary {meta['vocab_size']})"
    )
