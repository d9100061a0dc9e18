"""Where `lit-mesh export` and `export-hf` write: never over what is there unless asked (--force), never into or
around their input, and under a temporary name renamed into place, so that a failure leaves what was there."""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from lit_mesh.errors import OutputPathError

Kind = Literal["file", "directory"]


def _overlapping(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output(output: Path, source: Path, kind: Kind, force: bool) -> None:
    """Refuse an output that would destroy something: the input, or an existing path (unless force), or a path
    of the other kind (a file where a directory is written, or the reverse), or one nested in or around the input."""
    out, src = output.expanduser().resolve(), source.expanduser().resolve()
    if out == src and not force:
        raise OutputPathError(
            f"the output {str(output)!r} is the checkpoint itself: writing it would replace the checkpoint; name"
            " another output (or pass --force to replace the checkpoint)"
        )
    if out != src and _overlapping(out, src):
        raise OutputPathError(
            f"the output {str(output)!r} is inside the checkpoint {str(source)!r} or holds it: writing there would"
            " change the checkpoint; name an output outside it"
        )
    if output.exists() and (output.is_dir() != (kind == "directory")):
        other = "a directory" if output.is_dir() else "a file"
        raise OutputPathError(
            f"the output {str(output)!r} is {other}, and {'a directory' if kind == 'directory' else 'a file'} is"
            " written there; name another output"
        )
    if output.exists() and not force:
        raise OutputPathError(
            f"the output {str(output)!r} exists; name another output, or pass --force to replace it"
            + (" (the directory is replaced whole)" if kind == "directory" else "")
        )
    for parent in output.expanduser().absolute().parents:
        if parent.exists() and not parent.is_dir():
            raise OutputPathError(f"the output {str(output)!r} cannot be written: {str(parent)!r} is a file")


@contextmanager
def written_in_place(output: Path, kind: Kind) -> Generator[Path, None, None]:
    """Yields a temporary path beside `output` to write; on success it replaces `output` (a directory whole), on
    failure it is removed and `output` is as it was."""
    output = output.expanduser()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.partial-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if kind == "file":
            os.replace(tmp, output)
            return
        retired = output.with_name(f".{output.name}.old-{os.getpid()}")
        if output.exists():
            output.rename(retired)
        tmp.rename(output)
        _remove(retired)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
