"""Per-entry scales for 1-bit codes: every entry divided by its own running RMS before its sign is taken.

Why: a block of 1-bit codes decodes to one magnitude (the block's mean |x|). AdamW then normalises each
coordinate by its own second moment, so a coordinate whose gradients are small next to its block's receives
updates shrunk by that ratio: the run trains as a different, worse optimizer (benchmarks/README.md, "Gradient
compression"). Dividing by each entry's RMS first makes the entries of a block comparable, and multiplying the
decoded signs by the same RMS gives every coordinate back its own size.

Every rank must decode with the same scales, so they are shared: each rank keeps an exponential moving average
of its own uncompressed squared gradients; every `refresh` optimizer steps rank j sends the RMS of its chunk j
as 8-bit log codes (all-gather), and every rank decodes the same scales from them until the next refresh. The
codes cost 8 bits per entry once per `refresh` steps (counted on the wire like the gradient codes).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

EMA_DECAY = 0.95  # the local second moment follows about the last 20 micro-batches
CODE_STEPS_PER_OCTAVE = 4  # log codes: scale = 2 ** ((code - 128) / 4), 19% apart, 2**-32 .. 2**31.75
FLOOR = 1e-2  # no scale below 1% of its chunk's mean: entries that stopped getting gradients stay bounded


def encode_log(scale: Tensor) -> Tensor:
    """Positive scales -> uint8 codes (zero becomes the smallest code)."""
    codes = torch.round(torch.log2(scale.float()) * CODE_STEPS_PER_OCTAVE) + 128
    return codes.nan_to_num(0.0, posinf=255.0, neginf=0.0).clamp_(0, 255).to(torch.uint8)


def decode_log(codes: Tensor) -> Tensor:
    return torch.exp2((codes.float() - 128) / CODE_STEPS_PER_OCTAVE)


class EntryScales:
    """One reduction site's scales: its local second moment and the shared codes (x's layout, n chunks)."""

    def __init__(self, refresh: int) -> None:
        self.refresh = refresh
        self.local_sq: Optional[Tensor] = None  # this rank's EMA of its squared gradients (full buffer)
        self.codes: Optional[Tensor] = None  # shared by every rank of the group
        self.shared_at: int = -1  # the optimizer step of the last refresh

    def observe(self, gradient: Tensor) -> None:
        """Fold this rank's uncompressed gradient (before error feedback) into its second moment."""
        sq = gradient.detach().float().square()
        if self.local_sq is None or self.local_sq.shape != sq.shape:
            self.local_sq = sq
        else:
            self.local_sq.lerp_(sq, 1 - EMA_DECAY)

    def scales(self, n: int, group: Any, step: int, sent: Any) -> Tensor:
        """The shared scales (fp32, x's layout), refreshed first when due. `sent(buffer)` counts the
        all-gather's bytes; every rank of `group` calls this at the same steps."""
        assert self.local_sq is not None, "observe() a gradient first"
        numel = self.local_sq.numel()
        if self.codes is None or self.codes.numel() != numel or step - self.shared_at >= self.refresh:
            chunk = numel // n
            mine = dist.get_rank(group) * chunk
            local = encode_log(self.local_sq[mine : mine + chunk].sqrt())
            gathered = torch.empty(numel, dtype=torch.uint8, device=local.device)
            dist.all_gather_into_tensor(gathered, local, group=group)
            sent(gathered)
            self.codes, self.shared_at = gathered, step
        scales = decode_log(self.codes).view(n, -1)
        return torch.maximum(scales, FLOOR * scales.mean(1, keepdim=True)).view(-1)

    def state_dict(self) -> dict[str, Any]:
        return {"local_sq": self.local_sq, "codes": self.codes, "shared_at": self.shared_at}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        self.local_sq, self.codes, self.shared_at = move(state["local_sq"]), move(state["codes"]), state["shared_at"]
