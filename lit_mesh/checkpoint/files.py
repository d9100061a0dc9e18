"""The files of a sharded checkpoint written by MeshStrategy: load it into any mesh, check it before loading
(damaged ones are refused by name, with the checkpoint to use instead), publish and remove it atomically."""

from __future__ import annotations

import shutil
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lit_mesh.checkpoint.checksums import CHECKSUM_FILE, checksum_problems
from lit_mesh.checkpoint.resume import complete_checkpoints, newest_checkpoint
from lit_mesh.checkpoint.safe_load import (
    LAYOUT_FILE,
    load_weights_only,
    read_entries,
    read_layout,
    safe_dcp_load,
)
from lit_mesh.comm.state import DIRECTORY as COMPRESSION_DIRECTORY
from lit_mesh.errors import CheckpointError, NotACheckpointError, UnsafeCheckpointError  # imported from here too

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
    stored = read_layout(path).state_dict_metadata
    nested = f"{key}.param_groups.0.params" in stored
    return NESTED_OPTIMIZER_STATE_OPTIONS if nested else OPTIMIZER_STATE_OPTIONS


def _previous_sound(path: Path) -> Optional[Path]:
    """The newest other complete checkpoint of path's directory whose files pass shard_problems (read safely,
    checksums included), looking no further back than needed."""
    for other in reversed(complete_checkpoints(path.parent)):
        if other.resolve() != path.resolve() and (not other.is_dir() or not shard_problems(other)):
            return other
    return None


MODEL_KEYS = ("state_dict", "model")  # ModelParallelStrategy's and MeshStrategy's; Lightning FSDPStrategy's


def stored_model_key(path: Path) -> str:
    """Under which key the sharded checkpoint at `path` holds the model: "state_dict" (MeshStrategy,
    ModelParallelStrategy) or "model" (Lightning's FSDPStrategy with state_dict_type="sharded")."""
    stored = read_layout(path).state_dict_metadata
    return next((key for key in MODEL_KEYS if any(k.startswith(f"{key}.") for k in stored)), MODEL_KEYS[0])


def refusal(path: Path, problem: str) -> str:
    """The whole message: the checkpoint, what is wrong, that nothing was changed, and the previous complete one."""
    previous = _previous_sound(path)
    advice = (
        f"resume from the previous complete checkpoint, {str(previous)!r} (--ckpt_path={previous})"
        if previous is not None
        else f"there is no other complete checkpoint in {str(path.parent)!r}: start afresh or restore a copy"
    )
    return f"cannot load checkpoint {str(path)!r}: {problem}. Nothing in it was changed; {advice}"


def shard_problems(path: Path, share: tuple[int, int] = (0, 1)) -> Optional[str]:
    """What is wrong with the files of a sharded checkpoint: its layout (.metadata, read safely) unreadable or
    naming code, a shard file missing or shorter than the layout says, a file that differs from its checksum,
    a non-tensor entry that is no plain value. `share=(i, n)`: this process checks its n-th of the files (each
    of n ranks reads a different part; the caller gathers their answers)."""
    try:
        layout = read_layout(path)
    except UnsafeCheckpointError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - any failure to read it is the answer
        return f"its layout file {LAYOUT_FILE} cannot be read ({type(error).__name__}: {error})"
    needed: dict[str, int] = {}  # bytes each shard file must hold
    for info in (layout.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    missing = [name for name in sorted(needed) if not (path / name).is_file()]
    if missing:
        return f"shard file(s) {', '.join(missing)} of the {len(needed)} its layout lists are missing"
    short = [
        f"{name} holds {size} bytes, its layout needs {size_needed}"
        for name, size_needed in sorted(needed.items())
        if (size := (path / name).stat().st_size) < size_needed
    ]
    if short:
        return "truncated shard file(s): " + "; ".join(short)
    damaged = checksum_problems(path, share)
    if damaged:
        return damaged
    if share[0] == 0:  # the non-tensor entries (learning rates, step counts: small), read once
        entries = {key for key, value in layout.state_dict_metadata.items() if not hasattr(value, "size")}
        try:
            if entries:
                read_entries(path, entries)
        except UnsafeCheckpointError as error:
            return str(error)
        except Exception as error:  # noqa: BLE001 - damaged bytes
            return f"its non-tensor entries cannot be read ({type(error).__name__}: {error})"
    return None


def model_problems(path: Path, model: nn.Module, strict: bool) -> Optional[str]:
    """Tensors this model has that the checkpoint lacks (another model's weights), or of another shape."""
    # by key: TensorStorageMetadata (its .size) or BytesStorageMetadata (no size), told apart by hasattr below
    stored: dict[str, Any] = read_layout(path).state_dict_metadata
    prefix = f"{stored_model_key(path)}."
    held = {key[len(prefix) :] for key in stored if key.startswith(prefix)}
    ours = model.state_dict(keep_vars=True)  # names and shapes only: no detach (an inference-mode loop may run it)
    absent = [name for name in ours if name not in held]
    if strict and absent:
        extra = sorted(held - set(ours))
        return (
            f"it holds the weights of another model: {len(absent)} of this model's {len(ours)} tensors are not in it"
            f" (e.g. {', '.join(absent[:3])})"
            + (f", and it holds {len(extra)} tensors this model has not (e.g. {', '.join(extra[:3])})" if extra else "")
            + "; resume with the model it was saved from"
        )
    mismatched = [
        f"{name}: {tuple(stored[key].size)} in the checkpoint, {tuple(tensor.shape)} in this model"
        for name, tensor in ours.items()
        if (key := f"{prefix}{name}") in stored
        and hasattr(stored[key], "size")
        and tuple(stored[key].size) != tuple(tensor.shape)
    ]
    if mismatched:
        return (
            f"it holds a model of another shape ({len(mismatched)} tensors differ, e.g. "
            + "; ".join(mismatched[:3])
            + "); resume with the model configuration it was saved with"
        )
    return None


def _agreed(problem: Optional[str]) -> Optional[str]:
    """Every rank learns the first rank's problem (pipeline stages check different tensors), so all stop alike."""
    if not (dist.is_available() and dist.is_initialized()):
        return problem
    found: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    return next((p for p in found if p), None)


def verify_checkpoint(path: Path, model: Optional[nn.Module] = None, strict: bool = True) -> None:
    """Refuse a damaged checkpoint before anything is loaded, with one CheckpointError naming it and the fix."""
    collective = model is not None and dist.is_available() and dist.is_initialized()
    share = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)  # each rank checks its part
    problem = shard_problems(path, share)
    if problem is None and model is not None:
        problem = model_problems(path, model, strict)
    problem = _agreed(problem) if model is not None else problem
    if problem:
        raise CheckpointError(refusal(path, problem))


def _is_checkpoint_file(relative: Path) -> bool:
    # what torch.distributed.checkpoint, Lightning's meta.pt and lit_mesh/comm/state.py write
    name = relative.name
    if len(relative.parts) == 2 and relative.parts[0] == COMPRESSION_DIRECTORY:
        return name.startswith("rank") and name.endswith(".pt")
    return len(relative.parts) == 1 and (
        name in (LAYOUT_FILE, _METADATA_FILENAME, CHECKSUM_FILE) or name.endswith(".distcp")
    )


def refuse_overwriting_other_files(path: Path) -> None:
    """Saving over an existing checkpoint directory replaces it whole: refuse if it holds anything else."""
    if not path.is_dir():
        return
    others = sorted(
        str(f.relative_to(path))
        for f in path.rglob("*")
        if f.is_file() and not _is_checkpoint_file(f.relative_to(path))
    )
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


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint for retention (ModelCheckpoint's save_top_k), never the newest complete one of its
    directory (a resume after a crash needs it); a directory is renamed away first, so a crash mid-delete never
    leaves a half-deleted checkpoint that still looks complete."""
    if not path.exists():
        return
    if newest_checkpoint(path.parent) == path:
        rank_zero_warn(f"kept {str(path)!r}: it is the newest complete checkpoint of its directory (needed to resume)")
        return
    if path.is_dir():
        doomed = path.with_name(path.name + ".deleting")
        path.rename(doomed)
        shutil.rmtree(doomed)
    else:
        path.unlink()


@contextmanager
def failed_save_reported(staging: Path, path: Path) -> Generator[None, None, None]:
    """A save that fails (disk full, ...) removes its partial copy and says which checkpoints are still intact."""
    try:
        yield
    except (OSError, CheckpointException) as error:  # DCP reports a rank's write error on every rank as the latter
        shutil.rmtree(staging, ignore_errors=True)
        intact = [p.name for p in complete_checkpoints(path.parent)]
        kept = f"the previous checkpoints are intact: {', '.join(intact)}" if intact else "no earlier checkpoint exists"
        raise OSError(
            f"saving checkpoint {str(path)!r} failed ({error}); nothing was replaced and"
            f" {kept} (in {str(path.parent)!r}). Free space or choose another dirpath, then resume with ckpt_path='last'"
        ) from error


def _is_split_by_halves(tensor: DTensor, mesh_dim: int, placement: Placement) -> bool:
    # expert tensor parallel's packed [gate; up] split (lit_mesh/parallel/expert.py); FSDP2's strided shards over
    # a tp shard are one contiguous run each, which DCP writes as they are
    names = tensor.device_mesh.mesh_dim_names or ()
    return isinstance(placement, _StridedShard) and mesh_dim < len(names) and names[mesh_dim] == "tp"


def _with_placements(tensor: DTensor, placements: tuple[Placement, ...]) -> DTensor:
    device = tensor.device  # optimizer state offloaded to the CPU moves over the mesh's own device
    on_mesh = tensor
    if device.type != tensor.device_mesh.device_type:
        on_mesh = cast(DTensor, tensor.to(tensor.device_mesh.device_type))  # DTensor.to keeps a DTensor (typed Tensor)
    return cast(DTensor, on_mesh.redistribute(placements=placements).to(device))


def dcp_writable(state: Any) -> Any:
    """`state` with each DTensor split by halves over tp as the plain shard of the same dims (new containers
    where something changed; the rest as it is). torch 2.13's DCP writes one contiguous run per rank and dim, and
    refuses ("overlapping chunks") a rank that holds two (each half's slice of an expert's packed [gate; up])."""
    if isinstance(state, DTensor):
        plain = tuple(
            Shard(p.dim) if _is_split_by_halves(state, i, p) else p  # type: ignore[attr-defined]  # a Shard there
            for i, p in enumerate(state.placements)
        )
        return state if plain == tuple(state.placements) else _with_placements(state, plain)
    if isinstance(state, dict):
        return {key: dcp_writable(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(dcp_writable(value) for value in state)
    return state


def _placed_like(loaded: Any, template: Any) -> Any:
    """The inverse of dcp_writable: what was stored as plain shards, back in `template`'s placements."""
    if isinstance(template, DTensor) and isinstance(loaded, DTensor) and loaded is not template:
        return _with_placements(loaded, tuple(template.placements))
    if isinstance(template, dict):
        return {key: _placed_like(loaded[key], value) for key, value in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_placed_like(a, b) for a, b in zip(loaded, template))
    return loaded


MISSING_KEY = "Missing key in checkpoint state_dict: "  # torch's DefaultLoadPlanner's words for an absent entry


def _missing_keys(error: CheckpointException) -> list[str]:
    """The entries DCP found absent from the checkpoint (every rank's failure names its own), sorted."""
    found = [
        str(cause).split(MISSING_KEY, 1)[1].rstrip(".")
        for cause, _ in error.failures.values()
        if MISSING_KEY in str(cause)
    ]
    return sorted(set(found))


def dcp_load(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """dcp.load into a state laid out as dcp_writable saves it; returned in `state`'s own placements."""
    stored = dcp_writable(state)
    try:
        safe_dcp_load(stored, path)  # non-tensor entries as plain values only (verify_checkpoint read them first)
    except UnsafeCheckpointError as error:
        raise UnsafeCheckpointError(refusal(path, str(error))) from None
    except CheckpointException as error:  # raised alike on every rank (DCP's plan is global)
        missing = _missing_keys(error)
        if not missing:
            raise
        raise CheckpointError(
            f"cannot load checkpoint {str(path)!r}: it has no entry for {len(missing)} of the tensors to load (e.g."
            f" {', '.join(missing[:3])}): it was saved from a model or optimizer without them. The checkpoint is"
            " unchanged; resume with the model and optimizer it was saved with, or start from its weights alone as"
            " pretrained weights (`pretrained=DIR`, docs/transformers.md)"
        ) from None
    return _placed_like(stored, state)


def load_sharded_checkpoint(
    path: Path,
    model: nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    strict: bool = True,
    aliases: Optional[Mapping[str, str]] = None,
) -> dict:
    """Load a sharded checkpoint into `model` and `optimizers` as they are sharded now (any mesh, one device
    included: torch.distributed.checkpoint reshards); returns the rest of the checkpoint (loops, callbacks).

    `aliases`: parameter name -> the name of the parameter it is a copy of (a pipeline stage's copy of a tied
    matrix -> the whole model's name): where the checkpoint holds no optimizer state under the copy's name (saved
    without pp, the tied matrix one parameter), the copy takes the state saved under the other name.

    Lightning's loader refuses models without DTensor parameters (one device), hence our own.
    """
    metadata_file = path / _METADATA_FILENAME
    if not metadata_file.is_file():
        raise NotACheckpointError(
            refusal(
                path,
                f"the directory has no {_METADATA_FILENAME}: it is partial (an interrupted save?) or was not written"
                " by MeshStrategy or ModelParallelStrategy, so it does not point to a valid checkpoint",
            )
        )
    # first, and never unpickling code: a bad checkpoint fails before the model is touched
    try:
        metadata = load_weights_only(metadata_file, f"its {_METADATA_FILENAME}")
    except UnsafeCheckpointError as error:
        raise UnsafeCheckpointError(refusal(path, str(error))) from None
    verify_checkpoint(path, model, strict)
    key = stored_model_key(path)  # FSDPStrategy's sharded checkpoints hold the model under "model"
    stored = read_layout(path).state_dict_metadata
    template = get_model_state_dict(model)
    if not strict:  # strict_loading=False: load what the checkpoint holds, the model's other tensors keep theirs
        template = {name: value for name, value in template.items() if f"{key}.{name}" in stored}
    model_state = dcp_load({key: template}, path)
    model.load_state_dict(model_state[key], strict=strict)
    for key, optimizer in optimizers.items():
        options = stored_optimizer_state_options(path, key)  # either format loads, whoever wrote it
        saved_as = {
            copy: whole
            for copy, whole in (aliases or {}).items()
            if not any(name.startswith(f"{key}.state.{copy}.") for name in stored)
        }
        template = _renamed(get_optimizer_state_dict(model, optimizer, options=options), saved_as)
        optimizer_state = _renamed(dcp_load({key: template}, path)[key], {v: k for k, v in saved_as.items()})
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state, options=options)
    return metadata


def _renamed(state: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state dict, nested ({"state": {name: ...}, "param_groups": [{"params": [names]}]}) or flattened
    ("state.NAME.exp_avg", "param_groups.NAME.lr"), with the parameters `names` maps renamed."""
    if not names:
        return state
    if isinstance(state.get("state"), dict):
        groups = [{**group, "params": [names.get(p, p) for p in group["params"]]} for group in state["param_groups"]]
        return {**state, "state": {names.get(k, k): v for k, v in state["state"].items()}, "param_groups": groups}

    def key(flat: str) -> str:
        section, _, rest = flat.partition(".")
        old = next((name for name in names if rest.startswith(f"{name}.")), None)
        return flat if old is None else f"{section}.{names[old]}{rest[len(old) :]}"

    return {key(k): v for k, v in state.items()}
