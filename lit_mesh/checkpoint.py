"""Checkpoints written by MeshStrategy: load a sharded directory into any mesh, export one full file."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from lit_mesh.comm.state import DIRECTORY as COMPRESSION_DIRECTORY


# Optimizer state keyed by parameter name, hyper-parameters too ("param_groups.<name>.lr"): every rank's
# entries are its own, so pipeline stages (different parameters per rank) and any reshard load back exactly.
OPTIMIZER_STATE_OPTIONS = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)
# Lightning ModelParallelStrategy's format: {"state": {name: ...}, "param_groups": [...]} (one list per optimizer)
NESTED_OPTIMIZER_STATE_OPTIONS = StateDictOptions(cpu_offload=True)


def optimizer_state_options(pipeline: bool) -> StateDictOptions:
    """What MeshStrategy writes: Lightning's nested format without pipeline stages, so ModelParallelStrategy
    (and tools that read its checkpoints) can resume from it; the flattened one with pp > 1, where ranks hold
    different parameters and one param_groups list per optimizer could not describe them all."""
    return OPTIMIZER_STATE_OPTIONS if pipeline else NESTED_OPTIMIZER_STATE_OPTIONS


def stored_optimizer_state_options(path: Path, key: str) -> StateDictOptions:
    """The format `key` (e.g. "optimizer_0") was written in: nested (ModelParallelStrategy, MeshStrategy
    without pp) stores "param_groups.<index>.params"; flattened stores "param_groups.<parameter>.lr"."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    nested = f"{key}.param_groups.0.params" in stored
    return NESTED_OPTIMIZER_STATE_OPTIONS if nested else OPTIMIZER_STATE_OPTIONS


class NotACheckpointError(FileNotFoundError, ValueError):
    """A path that is no (complete) checkpoint; a ValueError too, as ModelParallelStrategy raises it."""


def _is_checkpoint_file(relative: Path) -> bool:
    # what torch.distributed.checkpoint, Lightning's meta.pt and lit_mesh/comm/state.py write
    name = relative.name
    if len(relative.parts) == 2 and relative.parts[0] == COMPRESSION_DIRECTORY:
        return name.startswith("rank") and name.endswith(".pt")
    return len(relative.parts) == 1 and (name in (".metadata", _METADATA_FILENAME) or name.endswith(".distcp"))


def refuse_overwriting_other_files(path: Path) -> None:
    """Saving over an existing checkpoint directory replaces it whole: refuse if it holds anything else."""
    if not path.is_dir():
        return
    others = sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file() and not _is_checkpoint_file(f.relative_to(path)))
    if others:
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise FileExistsError(
            f"cannot save the checkpoint to {str(path)!r}: the directory exists and holds files that are not part"
            f" of a checkpoint ({listed}); saving replaces the directory whole, so they would be deleted. Move them"
            " away, or save the checkpoint under another path"
        )


def publish_checkpoint(partial: Path, path: Path) -> None:
    """Move a finished checkpoint directory into place; an older one of the same name goes only after."""
    retired = path.with_name(path.name + ".old")
    if retired.exists():
        shutil.rmtree(retired)
    if path.is_dir():
        path.rename(retired)
    elif path.exists():
        path.unlink()
    partial.rename(path)
    if retired.exists():
        shutil.rmtree(retired)


def check_shapes(path: Path, model: nn.Module) -> None:
    """Refuse a checkpoint of a model of another shape, naming the tensors (torch's own error names none)."""
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    mismatched = [
        f"{name}: {tuple(stored[key].size)} in the checkpoint, {tuple(tensor.shape)} in this model"
        for name, tensor in model.state_dict().items()
        if (key := f"state_dict.{name}") in stored
        and hasattr(stored[key], "size")
        and tuple(stored[key].size) != tuple(tensor.shape)
    ]
    if mismatched:
        raise ValueError(
            f"checkpoint {str(path)!r} holds a model of another shape ({len(mismatched)} tensors differ, e.g. "
            + "; ".join(mismatched[:3])
            + "); resume with the model configuration it was saved with"
        )


def load_sharded_checkpoint(
    path: Path, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], strict: bool = True
) -> dict:
    """Load a sharded checkpoint into `model` and `optimizers` as they are sharded now (any mesh, one device
    included: torch.distributed.checkpoint reshards); returns the rest of the checkpoint (loops, callbacks).

    Lightning's loader refuses models without DTensor parameters (one device), hence our own.
    """
    metadata_file = path / _METADATA_FILENAME
    if not metadata_file.is_file():
        raise NotACheckpointError(
            f"checkpoint directory {str(path)!r} has no {_METADATA_FILENAME}: it is partial (an interrupted save?)"
            " or was not written by MeshStrategy or ModelParallelStrategy, so it does not point to a valid"
            " checkpoint; resume from another checkpoint"
        )
    # first, and never unpickling code: a bad checkpoint fails before the model is touched
    metadata = torch.load(metadata_file, map_location="cpu", weights_only=True)
    check_shapes(path, model)
    model_state = {"state_dict": get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=path)
    model.load_state_dict(model_state["state_dict"], strict=strict)
    for key, optimizer in optimizers.items():
        options = stored_optimizer_state_options(path, key)  # either format loads, whoever wrote it
        optimizer_state = {key: get_optimizer_state_dict(model, optimizer, options=options)}
        dcp.load(optimizer_state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return metadata


def load_full_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, unsharded, on the CPU, without a process group.

    Never unpickles code: sharded checkpoints are read by torch.distributed.checkpoint, single files with
    weights_only=True.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            merged = Path(tmp) / "full.pt"
            dcp_to_torch_save(path, merged)
            state = torch.load(merged, map_location="cpu", weights_only=True)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    if "state_dict" not in state:
        raise ValueError(f"{str(path)!r} holds no 'state_dict' entry: is it a Lightning checkpoint?")
    return {name: tensor for name, tensor in state["state_dict"].items() if isinstance(tensor, torch.Tensor)}


def export_full_state_dict(checkpoint: str | Path, output: str | Path, prefix: str = "") -> Path:
    """Write the model weights of `checkpoint` to `output` (torch.save); keep keys under `prefix`, stripped."""
    weights = load_full_state_dict(checkpoint)
    if prefix:
        start = prefix.rstrip(".") + "."
        weights = {name[len(start):]: t for name, t in weights.items() if name.startswith(start)}
        if not weights:
            raise ValueError(f"no weights under prefix {prefix!r} in {str(checkpoint)!r}")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out)
    return out
