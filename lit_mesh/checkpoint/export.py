"""A checkpoint's model weights, unsharded, without a process group: `lit-mesh export` (one torch file) and the
conversion to transformers (zoo/convert/export.py) read them through here."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lit_mesh.checkpoint.files import CheckpointError, NotACheckpointError, refusal, verify_checkpoint


def load_full_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, unsharded, on the CPU, without a process group.

    Never unpickles code: sharded checkpoints are read by torch.distributed.checkpoint, single files with
    weights_only=True.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        if not (path / ".metadata").is_file():
            raise NotACheckpointError(
                refusal(path, "the directory has no .metadata: it is no complete sharded checkpoint")
            )
        verify_checkpoint(path)
        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "full.pt"
            dcp_to_torch_save(path, merged)
            state = torch.load(merged, map_location="cpu", weights_only=True)
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError) as error:  # truncated or not a torch file
            raise CheckpointError(
                refusal(path, f"the file cannot be read ({type(error).__name__}: {error})")
            ) from error
    if "state_dict" not in state:
        raise ValueError(f"{str(path)!r} holds no 'state_dict' entry: is it a Lightning checkpoint?")
    return {name: tensor for name, tensor in state["state_dict"].items() if isinstance(tensor, torch.Tensor)}


def export_full_state_dict(checkpoint: str | Path, output: str | Path, prefix: str = "") -> Path:
    """Write the model weights of `checkpoint` to `output` (torch.save); keep keys under `prefix`, stripped."""
    weights = load_full_state_dict(checkpoint)
    if prefix:
        start = prefix.rstrip(".") + "."
        weights = {name[len(start) :]: t for name, t in weights.items() if name.startswith(start)}
        if not weights:
            raise ValueError(f"no weights under prefix {prefix!r} in {str(checkpoint)!r}")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out)
    return out
