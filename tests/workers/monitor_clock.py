"""A MeshMonitor whose clock advances exactly 0.25 s per reading, so every measured step takes 0.25 s."""

from __future__ import annotations

from lit_mesh.monitor import MeshMonitor

STEP_SECONDS = 0.25


class SteppingClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += STEP_SECONDS
        return self.now


class SteppingClockMonitor(MeshMonitor):
    def __init__(self, peak_flops_per_device: float | None = None) -> None:
        super().__init__(peak_flops_per_device=peak_flops_per_device, clock=SteppingClock())
