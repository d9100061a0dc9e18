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
import re
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
        try:
            return require("tokenizers").Tokenizer.from_file(str(source))
        except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for any bad file
            raise PrepareDataError(
                f"--tokenizer {path} is no tokenizer.json ({_first_line(error)}); give the tokenizer.json a"
                " tokenizer saved (tokenizer.save(PATH)), or the directory save_pretrained wrote"
            ) from None
    if source.is_dir():
        AutoTokenizer = require("transformers").AutoTokenizer

        try:
            # never the directory's own code (auto_map): no prompt, no import of files that came with the data
            tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True, trust_remote_code=False)
        except Exception as error:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError, ...
            raise PrepareDataError(
                f"--tokenizer {path}: transformers cannot load a tokenizer from this directory"
                f" ({type(error).__name__}: {_first_line(error)}); give a directory written by"
                " tokenizer.save_pretrained(DIR) (without custom code), or a tokenizer.json"
            ) from None
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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


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
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError):  # transformers read it already; a file it took is no reason to stop
        return []
    if isinstance(eos, dict):
        eos = eos.get("content")
    return [eos] if isinstance(eos, str) and eos else []


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


PIECE_CHARS = 1 << 18  # a text file is tokenised in pieces of about this many characters (memory bounded by it)
MAX_PIECE_CHARS = 1 << 20  # a piece with no clean cut this long is cut at any line end (see _text_pieces)


def documents(path: Path, text_key: str) -> Iterator[Iterator[str]]:
    """The documents of one input, each as its text in pieces: a text file is one document (pieces of about
    PIECE_CHARS); JSONL and parquet give one per row (one piece each). Input that is not text is refused."""
    if path.suffix in _JSONL:
        yield from ([text] for text in _jsonl_texts(path, text_key))
    elif path.suffix in _PARQUET:
        for row_number, row in enumerate(_parquet_rows(path)):
            yield [_text_of(row, text_key, f"{path} row {row_number}")]
    else:
        yield _text_pieces(path)


def _jsonl_texts(path: Path, text_key: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            where = f"{path}:{line_number}"
            line = _decoded(raw, where)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise PrepareDataError(
                    f"{where} is not JSON ({error}); each line of a .jsonl file is one JSON object"
                ) from None
            yield _text_of(row, text_key, where)


def _decoded(raw: bytes, where: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PrepareDataError(
            f"{where} is not UTF-8 text (byte {error.start}: {raw[error.start : error.start + 4]!r}); convert it to"
            " UTF-8, or leave it out"
        ) from None
    if "\x00" in text:
        raise PrepareDataError(f"{where} holds NUL bytes: a binary file, not text; leave it out of the inputs")
    return text


def _text_pieces(path: Path) -> Iterator[str]:
    """A text file's text, strictly UTF-8, in pieces of about PIECE_CHARS cut after a newline that is followed by
    a non-space character: a boundary every common pre-tokenizer (byte-level BPE, whitespace, metaspace) makes
    anyway, so the tokens are those of the whole text. Text without such a line for MAX_PIECE_CHARS is cut at
    the next line end (a token or two there may differ from the whole text's): memory stays bounded."""
    piece: list[str] = []
    size = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            # universal newlines, as text mode reads them: the tokens of a CRLF file are those they always were
            line = _decoded(raw, f"{path}:{line_number}").replace("\r\n", "\n").replace("\r", "\n")
            clean_cut = bool(line[:1]) and not line[:1].isspace()
            if (size >= PIECE_CHARS and clean_cut) or size >= MAX_PIECE_CHARS:
                yield "".join(piece)
                piece, size = [], 0
            piece.append(line)
            size += len(line)
    if piece:
        yield "".join(piece)


def _text_of(row: Any, text_key: str, where: str) -> str:
    if not isinstance(row, dict):
        raise PrepareDataError(f"{where} is a JSON {type(row).__name__}, not an object with a {text_key!r} field")
    if text_key not in row:
        raise PrepareDataError(f"{where} has no key {text_key!r} (keys: {sorted(row)[:8]}); pass --text-key KEY")
    text = row[text_key]
    if not isinstance(text, str):
        shown = "null" if text is None else type(text).__name__
        raise PrepareDataError(
            f"{where}: its {text_key!r} is {shown}, not text; fix or drop that row (or name the text field with"
            " --text-key KEY)"
        )
    return text


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


def _temporary(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


# prepare-data's own temporary files (_temporary): the only ones a re-run removes from --out
_OWN_TEMPORARY = re.compile(r"(train|val)-\d{5}\.bin\.tmp|part-\d{5}\.json\.tmp|" + re.escape(META_FILE) + r"\.tmp")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


_TOKENIZER: Any = None  # one per worker process, loaded once
BATCH_CHARS = 1 << 20  # pieces are tokenised in batches of about this many characters (~200 bytes each in tokenizers)


def _batches(path: Path, text_key: str) -> Iterator[list[tuple[str, bool]]]:
    """(piece, ends its document) in batches of about BATCH_CHARS; documents that are all whitespace are left
    out (an empty document adds no EOS)."""
    batch: list[tuple[str, bool]] = []
    size = 0
    for document in documents(path, text_key):
        held: list[str] = []  # leading blank pieces, kept until the document shows text
        seen_text = False
        for piece in document:
            if not seen_text:
                held.append(piece)
                seen_text = bool(piece.strip())
                if not seen_text:
                    continue
                pending, held = held, []
            else:
                pending = [piece]
            for text in pending:
                batch.append((text, False))
                size += len(text)
            if size >= BATCH_CHARS and len(batch) > 1:
                *full, last = batch
                yield full
                batch, size = [last], len(last[0])
        if seen_text:
            batch[-1] = (batch[-1][0], True)
    if batch:
        yield batch


def _tokenize_part(task: tuple[int, str, str, Settings]) -> dict[str, Any]:
    """Tokenise input `index` into its shards, a batch of text at a time (memory bounded by the batch, not the
    file), then write its part record; returns the record."""
    global _TOKENIZER
    index, source, out_dir, settings = task
    if _TOKENIZER is None:
        _TOKENIZER = load_tokenizer(settings.tokenizer)
    path, out = Path(source), Path(out_dir)
    dtype = np.dtype(DTYPES[settings.dtype])
    train_name, val_name, part_name = _shard_names(index)
    every = _temporary(out / train_name)  # all tokens first; the tail moves to the validation shard below
    total = documents_seen = 0
    try:
        with open(every, "wb") as f:
            for batch in _batches(path, settings.text_key):
                encoded = _TOKENIZER.encode_batch([text for text, _ in batch], add_special_tokens=False)
                for (_, ends), e in zip(batch, encoded):
                    ids = np.asarray(e.ids + [settings.eos_id] if ends else e.ids, dtype=dtype)
                    f.write(ids.tobytes())
                    total += len(ids)
                    documents_seen += ends
        n_val = int(round(total * settings.val_fraction))
        _move_tail(every, _temporary(out / val_name), (total - n_val) * dtype.itemsize)
        os.replace(every, out / train_name)
        os.replace(_temporary(out / val_name), out / val_name)
    finally:  # refused input: no temporary file left behind
        for tmp in (every, _temporary(out / val_name)):
            tmp.unlink(missing_ok=True)
    record = {
        **_record_of(path, settings),
        "train_tokens": total - n_val,
        "val_tokens": n_val,
        "documents": documents_seen,
    }
    _write_atomic(out / part_name, json.dumps(record).encode())  # last: the part is complete
    return record


def _move_tail(source: Path, target: Path, start: int, chunk: int = 16 << 20) -> None:
    """The bytes of `source` from `start` on, copied to `target` a chunk at a time; `source` cut at `start`."""
    with open(source, "rb") as f, open(target, "wb") as g:
        f.seek(start)
        while data := f.read(chunk):
            g.write(data)
    os.truncate(source, start)


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
    out_dir = Path(out).expanduser()
    _check_out(out_dir, inputs)
    info = tokenizer_info(tokenizer, eos_token)
    settings = Settings(info.path, info.eos_id, token_dtype(info.vocab_size, dtype), text_key, val_fraction)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.iterdir():  # our own temporary files, left by an interrupted run (never anyone else's)
        if _OWN_TEMPORARY.fullmatch(stale.name) and stale.is_file():
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


def _check_out(out_dir: Path, inputs: Sequence[str]) -> None:
    """--out must be a directory (or not exist yet), outside every input directory: shards written into an input
    directory would be read as input by the next run."""
    for parent in (out_dir, *out_dir.absolute().parents):
        if parent.exists() and not parent.is_dir():
            raise PrepareDataError(
                f"--out {out_dir}: {str(parent)!r} is a file; --out names the directory to write the shards to"
            )
    resolved = out_dir.resolve()
    for item in inputs:
        directory = Path(item).expanduser()
        if directory.is_dir() and (resolved == directory.resolve() or directory.resolve() in resolved.parents):
            raise PrepareDataError(
                f"--out {out_dir} is inside the input directory {item!r}: the shards written there would be read"
                " as input; choose an --out outside the inputs"
            )


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
    except (PrepareDataError, OSError) as error:  # bad input, or a path that cannot be read or written
        parser.exit(2, f"lit-mesh prepare-data: error: {error}\n")
    tokens = {split: sum(s["tokens"]) for split, s in meta["splits"].items()}
    print(
        f"wrote {args.out}: {tokens['train']} train and {tokens['val']} validation tokens ({meta['dtype']},"
        f" {meta['documents']} documents, vocabulary {meta['vocab_size']})"
    )
