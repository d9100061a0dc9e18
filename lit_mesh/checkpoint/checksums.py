"""Per-file checksums of a sharded checkpoint: written once every rank has written its shards, verified before a
load, so that a damaged shard (a bad disk, a partial copy, bytes overwritten) is refused instead of loaded as
wrong weights. They catch damage, not forgery: whoever can rewrite a shard can rewrite this file too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from lightning.fabric.utilities.load import _METADATA_FILENAME

CHECKSUM_FILE = ".checksums.json"
_ALGORITHM = "sha256"
_CHUNK = 16 << 20  # hashlib releases the GIL for buffers this large (an async save's thread leaves training be)


def file_digest(path: Path) -> str:
    digest = hashlib.new(_ALGORITHM)
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def covered_files(directory: Path) -> list[str]:
    """The files checksummed: the shards (*.distcp) and Lightning's meta.pt (.metadata is checked by reading it)."""
    covered = (p for p in directory.iterdir() if p.suffix == ".distcp" or p.name == _METADATA_FILENAME)
    return sorted(p.name for p in covered if p.is_file())


def write_checksums(directory: Path) -> None:
    """Write CHECKSUM_FILE into a checkpoint directory whose files are all written (before it is published)."""
    digests = {name: file_digest(directory / name) for name in covered_files(directory)}
    tmp = directory / (CHECKSUM_FILE + ".tmp")
    tmp.write_text(json.dumps({_ALGORITHM: digests}, indent=1))
    os.replace(tmp, directory / CHECKSUM_FILE)


def checksum_problems(directory: Path, share: tuple[int, int] = (0, 1)) -> Optional[str]:
    """What differs from the checksums written at save time; None without a checksum file (checkpoints written
    by ModelParallelStrategy, or by lit-mesh before checksums). `share=(i, n)`: check every n-th file from the i-th, so
    that n ranks read each file once between them."""
    listing = directory / CHECKSUM_FILE
    if not listing.is_file():
        return None
    try:
        digests = json.loads(listing.read_text())[_ALGORITHM]
        assert isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as error:
        return f"its checksum file {CHECKSUM_FILE} cannot be read ({type(error).__name__})"
    strays = [name for name in digests if Path(name).name != name or name in ("", ".", "..")]
    if strays:  # a name pointing out of the directory is no file of this checkpoint
        return f"its checksum file {CHECKSUM_FILE} names files outside the checkpoint ({', '.join(strays[:3])})"
    index, count = share
    differing = []
    for name in sorted(digests)[index::count]:
        file = directory / name
        if not file.is_file():
            differing.append(f"{name} is missing")
        elif file_digest(file) != digests[name]:
            differing.append(f"{name} differs from the file that was saved")
    if differing:
        return f"damaged file(s), checked against {CHECKSUM_FILE}: " + "; ".join(differing)
    return None
