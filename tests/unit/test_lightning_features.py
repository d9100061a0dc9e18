"""MeshStrategy configures Lightning's launcher, which validates the SLURM settings (no processes started).
Lightning features across ranks: tests/integration/test_lightning_features.py."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lit_mesh import MeshStrategy


def test_launcher_is_configured_and_validates_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    slurm = {
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "1234",
        "SLURM_NODELIST": "localhost",
    }
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    trainer = Trainer(accelerator="cpu", devices=4, strategy=MeshStrategy(), logger=False)
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)
    assert trainer.strategy.cluster_environment.creates_processes_externally
    # the allocation has 4 tasks per node, the Trainer asks for 2 devices: refused when the Trainer is made
    with pytest.raises(ValueError, match="ntasks"):
        Trainer(accelerator="cpu", devices=2, strategy=MeshStrategy(), logger=False)
