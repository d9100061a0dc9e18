"""A checkpoint's model weights, unsharded, without a process group: `lit-mesh export` (one torch file) and the
conversion to transformers (zoo/convert/export.py) read them through here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lit_mesh.checkpoint.files import CheckpointError, NotACheckpointError, refusal, verify_checkpoint
from lit_mesh.checkpoint.output import check_output, written_in_place
from lit_mesh.checkpoint.safe_load import LAYOUT_FILE, load_weights_only, read_entries
from lit_mesh.errors import UnsafeCheckpointError


def _read_single_file(path: Path) -> Any:
    try:
        return load_weights_only(path, "the file")
    except UnsafeCheckpointError as error:
        raise UnsafeCheckpointError(refusal(path, str(error))) from None
    except Exception as error:  # noqa: BLE001 - not a torch file: the unpickler fails in many ways (KeyError, ...)
        raise CheckpointError(
            refusal(path, f"the file cannot be read as a checkpoint ({type(error).__name__}: {error})")
        ) from error


def load_full_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, unsharded, on the CPU, without a process group.

    Never runs code from the files (lit_mesh/checkpoint/safe_load.py): the layout of a sharded checkpoint is read
    by an allow-listing unpickler, everything else with weights_only=True; a sharded checkpoint is verified first.
    """
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise NotACheckpointError(
            f"checkpoint {str(path)!r} does not exist; name a checkpoint directory written by MeshStrategy"
            " (e.g. checkpoints/last.ckpt) or a Lightning checkpoint file"
        )
    if path.is_dir():
        if not (path / LAYOUT_FILE).is_file():
            raise NotACheckpointError(
                refusal(path, f"the directory has no {LAYOUT_FILE}: it is no complete sharded checkpoint")
            )
        verify_checkpoint(path)  # layout, shard sizes, checksums and non-tensor entries, read safely
        state = read_entries(path)
    else:
        state = _read_single_file(path)
    if not isinstance(state, dict) or not isinstance(state.get("state_dict"), dict):
        raise CheckpointError(
            f"{str(path)!r} holds no 'state_dict' entry, so it is no Lightning checkpoint (a bare state dict"
            " is already what export writes: load it with torch.load(path, weights_only=True))"
        )
    return {name: tensor for name, tensor in state["state_dict"].items() if isinstance(tensor, torch.Tensor)}


def weights_under(weights: dict[str, torch.Tensor], prefix: str, checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The weights under `prefix` ("model" or "model."), the prefix stripped; every weight for an empty prefix."""
    if not prefix:
        return weights
    start = prefix.rstrip(".") + "."
    kept = {name[len(start) :]: t for name, t in weights.items() if name.startswith(start)}
    if not kept:
        tops = sorted({name.split(".", 1)[0] for name in weights})
        raise CheckpointError(
            f"no weights under prefix {prefix!r} in {str(checkpoint)!r}; its top-level names are"
            f" {', '.join(tops[:8]) or '(none)'}: pass one of them as --prefix, or --prefix '' for all"
        )
    return kept


def export_full_state_dict(checkpoint: str | Path, output: str | Path, prefix: str = "", force: bool = False) -> Path:
    """Write the model weights of `checkpoint` to `output` (torch.save); keep keys under `prefix`, stripped.

    An existing `output` (the checkpoint itself included) is replaced only with force=True; it is written under a
    temporary name and renamed, so a failure leaves what was there."""
    out = Path(output)
    check_output(out, Path(checkpoint), "file", force)  # before the (long) read
    weights = weights_under(load_full_state_dict(checkpoint), prefix, checkpoint)
    with written_in_place(out, "file") as tmp:
        torch.save(weights, tmp)
    return out
