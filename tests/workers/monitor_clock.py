"""A MeshMonitor whose clock advances exactly 0.25 s per reading (so every timed window takes 0.25 s), and
refuses to be read while a dispatch mode (the monitor's byte counting) is active: bytes are never counted
inside a timed window."""

from __future__ import annotations

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lit_mesh.monitor import MeshMonitor

STEP_SECONDS = 0.25


class SteppingClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        modes = _get_current_dispatch_mode_stack()
        assert not modes, f"the clock is read inside a dispatch mode: {modes}"
        self.now += STEP_SECONDS
        return self.now


class SteppingClockMonitor(MeshMonitor):
    def __init__(self, peak_flops: float | None = None) -> None:
        super().__init__(peak_flops=peak_flops, clock=SteppingClock())
