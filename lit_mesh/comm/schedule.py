"""The compression schedule: which mode the gradient reductions use at each optimizer step.

Its phases come from CompressionOptions.phases() (uncompressed warm-up, `mode`, then the user's schedule). The
next phase starts at its `start_step`, or once the global norm of the reduced gradients has changed by less than
its `grad_norm_change_below` for `patience` steps in a row. Every rank must switch at the same step, so the rule
decides on the norm summed over the world.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lit_mesh.comm.options import CompressionPhase


class CompressionSchedule:
    """The current phase (`index` into `phases`) and the gradient-norm statistics its rule needs."""

    def __init__(self, phases: list[CompressionPhase], device: torch.device) -> None:
        self.phases = phases
        self.device = device
        self.index = 0
        self.step = -1
        # squared norm of this rank's reduced gradients in the current step, on the device: no host read per bucket
        self._sumsq = torch.zeros((), dtype=torch.float64, device=device)
        self._last_norm: Optional[float] = None
        self._calm_steps = 0

    @property
    def mode(self) -> str:
        return self.phases[self.index].mode

    @property
    def onebit_scheduled(self) -> bool:
        """1-bit now or in a later phase."""
        return any(phase.mode == "onebit" for phase in self.phases[self.index :])

    @property
    def _rule_pending(self) -> bool:
        nxt = self.phases[self.index + 1] if self.index + 1 < len(self.phases) else None
        return nxt is not None and nxt.grad_norm_change_below is not None

    def record_norm(self, reduced: Tensor) -> None:
        if self._rule_pending:
            self._sumsq = self._sumsq + reduced.detach().float().pow(2).sum().double()

    def advance(self, step: int) -> None:
        """Move to `step` (a new optimizer step): close the last step's norm, then start every phase that is due."""
        if self._rule_pending and self.step >= 0:
            self._observe_grad_norm()
        self.step = step
        while self.index + 1 < len(self.phases):
            nxt = self.phases[self.index + 1]
            by_step = nxt.start_step is not None and step >= nxt.start_step
            by_rule = nxt.grad_norm_change_below is not None and self._calm_steps >= nxt.patience
            if not (by_step or by_rule):
                break
            self.index += 1
            self._calm_steps, self._last_norm = 0, None

    def _observe_grad_norm(self) -> None:
        # every rank must switch at the same step: decide on the norm summed over the world
        total = self._sumsq.reshape(1).to(self.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        norm = float(total.sqrt())  # the one host read of the step
        self._sumsq = torch.zeros((), dtype=torch.float64, device=self.device)
        threshold = cast(float, self.phases[self.index + 1].grad_norm_change_below)  # set: _rule_pending
        if self._last_norm is not None and self._last_norm > 0:
            calm = abs(norm - self._last_norm) / self._last_norm < threshold
            self._calm_steps = self._calm_steps + 1 if calm else 0
        self._last_norm = norm

    # checkpoint keys as written before phases had their own word ("stage": the phase index), so old files load
    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.index,
            "step": self.step,
            "sumsq": float(self._sumsq),
            "last_norm": self._last_norm,
            "calm_steps": self._calm_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.index, self.step = state["stage"], state["step"]
        self._last_norm, self._calm_steps = state["last_norm"], state["calm_steps"]
        self._sumsq = torch.tensor(float(state["sumsq"]), dtype=torch.float64, device=self.device)
