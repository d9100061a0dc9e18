"""Checkpoints: the files of a sharded checkpoint (`files`: load into any mesh, verify, publish, remove), how
MeshStrategy writes them (`writer`, `async_save`), the newest complete one to resume from (`resume`), a checkpoint's
weights as one unsharded file (`export`), and pretrained weights read into the sharded model (`pretrained`).

`from lit_mesh.checkpoint import X` keeps working for every name the module lit_mesh/checkpoint.py had before it
became this package. The modules of this package import each other by their own names, never through here.
"""

from lit_mesh.checkpoint.export import export_full_state_dict, load_full_state_dict
from lit_mesh.checkpoint.files import (
    NESTED_OPTIMIZER_STATE_OPTIONS,
    OPTIMIZER_STATE_OPTIONS,
    CheckpointError,
    NotACheckpointError,
    dcp_load,
    dcp_writable,
    failed_save_reported,
    load_sharded_checkpoint,
    model_problems,
    optimizer_state_options,
    publish_checkpoint,
    refuse_overwriting_other_files,
    remove_checkpoint,
    shard_problems,
    stored_optimizer_state_options,
    verify_checkpoint,
)

__all__ = [
    "NESTED_OPTIMIZER_STATE_OPTIONS",
    "OPTIMIZER_STATE_OPTIONS",
    "CheckpointError",
    "NotACheckpointError",
    "dcp_load",
    "dcp_writable",
    "export_full_state_dict",
    "failed_save_reported",
    "load_full_state_dict",
    "load_sharded_checkpoint",
    "model_problems",
    "optimizer_state_options",
    "publish_checkpoint",
    "refuse_overwriting_other_files",
    "remove_checkpoint",
    "shard_problems",
    "stored_optimizer_state_options",
    "verify_checkpoint",
]
