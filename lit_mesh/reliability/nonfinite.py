"""Stop every rank together when a training loss turns NaN or infinite, without a host sync on every step.

Trade-off: on each step every rank only records, on its device, the first step whose loss was not finite (no
host sync, no collective). The ranks compare notes (one world all-reduce of one float per rank, one host read)
on logging steps (Trainer `log_every_n_steps`), before a checkpoint is written and when training ends. A NaN is
therefore reported up to one logging interval late — those steps train on from broken weights, which stopping
discards anyway — and a step that logs nothing pays nothing for the check. Every rank raises the same error, at
the same step, naming the first bad step and the ranks that saw it then.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


class NonFiniteLossGuard:
    """record(loss, step) on every step; check() on every rank at the same points to raise together."""

    def __init__(self) -> None:
        # this rank's first step with a non-finite loss, plus 1 (0: none); float32 like the vote (exact < 2**24)
        self._first_bad: Optional[Tensor] = None

    def record(self, loss: object, step: int) -> None:
        if not isinstance(loss, Tensor):  # a training_step that returned no loss
            return
        bad = ~torch.isfinite(loss.detach()).all()
        if self._first_bad is None:
            self._first_bad = torch.zeros((), device=loss.device)
        # device ops only: no host read of `bad`
        self._first_bad = torch.where(bad & (self._first_bad == 0), float(step + 1), self._first_bad)

    def check(self, device: torch.device) -> None:
        """Every rank calls it at the same point: raises FloatingPointError on all of them if any rank recorded
        a non-finite loss."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        votes = torch.zeros(world, device=device)  # one slot per rank: every rank learns which ranks failed
        if self._first_bad is not None:
            votes[rank] = self._first_bad.to(device)
        if dist.is_initialized():
            dist.all_reduce(votes)
        first_bad = votes.tolist()
        bad = [step for step in first_bad if step > 0]
        if bad:  # the ranks where it began (NaN weights reach the others at the next gradient reduction)
            step = int(min(bad)) - 1
            ranks = [r for r, first in enumerate(first_bad) if first == step + 1]
            raise FloatingPointError(
                f"non-finite training loss at step {step} on rank(s) {ranks}: stopping. Lower the learning rate,"
                " set gradient_clip_val, try precision='32-true', or resume from the last checkpoint"
                " (stop_on_nonfinite_loss=False turns this check off)"
            )
