"""Every rank selects its own device before the process group and the mesh are made, and the process group is
bound to it (NCCL's `device_id`). Checked in-process for each rank of a 4-rank job, with a stand-in CUDA
accelerator and process-group/mesh builders that record their calls (no GPU needed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CUDAAccelerator

import lit_mesh.strategy as strategy_module
from lit_mesh import MeshStrategy


class RecordingCUDA(CUDAAccelerator):
    """CUDAAccelerator whose device setup records the device instead of calling torch.cuda.set_device."""

    def __init__(self, events: list) -> None:
        self.events = events

    def setup_device(self, device: torch.device) -> None:
        self.events.append(("set_device", device))


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_each_rank_selects_its_device_before_the_process_group_and_the_mesh(
    local_rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, Any]] = []
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", str(local_rank))

    def init_process_group(backend: str, **kwargs: Any) -> None:
        events.append(("init_process_group", backend, kwargs.get("device_id")))

    def build_mesh(layout: Any, device_type: str, timeout: Any = None) -> Any:
        events.append(("mesh", device_type))
        raise _Stop  # the rest of setup_environment needs a real process group

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(strategy_module, "build_device_mesh", build_mesh)

    strategy = MeshStrategy(dp_shard=4)
    strategy.accelerator = RecordingCUDA(events)
    strategy.parallel_devices = [torch.device("cuda", i) for i in range(4)]
    strategy.cluster_environment = LightningEnvironment()
    strategy.set_world_ranks()
    with pytest.raises(_Stop):
        strategy.setup_environment()

    device = torch.device("cuda", local_rank)
    assert events == [("set_device", device), ("init_process_group", "nccl", device), ("mesh", "cuda")]


class _Stop(Exception):
    pass
