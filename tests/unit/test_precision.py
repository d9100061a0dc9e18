"""fp16 mixed precision: the plugin carries the mesh's loss scaler, and without it fp16 is refused before any
process starts. The scaler's agreement over ranks: tests/integration/test_precision.py."""

from __future__ import annotations

import lightning as L
import pytest

from lit_mesh import FP16MixedPrecision, MeshStrategy
from lit_mesh.precision import MeshGradScaler


def test_fp16_plugin_carries_the_mesh_scaler() -> None:
    plugin = FP16MixedPrecision(device="cpu")
    assert plugin.precision == "16-mixed" and isinstance(plugin.scaler, MeshGradScaler)


def test_fp16_without_the_mesh_scaler_is_refused_before_processes_start() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.raises(ValueError, match=r"FP16MixedPrecision"):  # raised by Trainer(...): nothing spawned yet
        L.Trainer(accelerator="cpu", devices=2, strategy=MeshStrategy(), plugins=[MixedPrecision("16-mixed", "cpu")])
