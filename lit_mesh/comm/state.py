"""Gradient-compression state in sharded checkpoints: one file per rank, `grad_compression/rank<R>.pt`.

Residuals are per-rank data, so a resume on the same layout continues exactly. On another layout (world
size, mesh degrees or reduction sites differ) the saved residuals do not fit the new shards: residuals and
PowerSGD factors are reset with a warning, the schedule's position is kept. What is lost is what compression
dropped in the last step before the save, which error feedback would have re-sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mesh.comm.compression import CompressionRun

DIRECTORY = "grad_compression"


def _file(checkpoint_dir: Path, rank: int) -> Path:
    return checkpoint_dir / DIRECTORY / f"rank{rank}.pt"


def save_compression_state(run: CompressionRun, checkpoint_dir: Path, rank: int, world_size: int, layout: str) -> None:
    path = _file(checkpoint_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"world_size": world_size, "layout": layout, "sites": sorted(run.sites), "state": run.state_dict()}
    torch.save(state, path)


def load_compression_state(
    run: CompressionRun, checkpoint_dir: Path, rank: int, world_size: int, layout: str
) -> Optional[str]:
    """Restore this rank's state; returns why it was not restored (None when it was)."""
    path = _file(checkpoint_dir, rank)
    if not path.exists():
        why = f"{checkpoint_dir} holds no gradient-compression state (saved without compression)"
    else:
        saved = torch.load(path, map_location=run.device, weights_only=True)
        if saved["world_size"] != world_size or saved["layout"] != layout:
            why = f"it was saved on {saved['layout']!r}, this run is {layout!r}"
        elif saved["sites"] != sorted(run.sites):
            why = "its reduction sites (FSDP units) differ from this model's"
        else:
            run.load_state_dict(saved["state"])
            return None
        run.load_state_dict(saved["state"], sites=False)  # the schedule's position still holds
    rank_zero_warn(
        f"gradient compression starts afresh (residuals and PowerSGD factors reset): {why}. Resume on the same"
        " mesh layout to continue exactly"
    )
    return why
