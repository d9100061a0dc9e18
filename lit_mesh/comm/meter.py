"""Bytes on the wire of the gradient reductions, counted from the buffers the collectives are given.

Per mesh dim and step: `sent` (what this rank sends with compression) and `uncompressed` (what the plain
collective on the same gradient would have sent). Ring-algorithm model over n ranks, the same as
lit_mesh.monitor.comm: all-reduce 2(n-1)/n of the buffer, reduce-scatter (n-1)/n of the input, all-gather
(n-1)/n of the output, all-to-all (n-1)/n of the input.
"""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor

_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def wire_bytes(kind: str, buffer: Tensor | int, n: int) -> float:
    """Bytes one rank sends for collective `kind` over n ranks, `buffer` being the size that counts."""
    size = buffer if isinstance(buffer, int) else buffer.numel() * buffer.element_size()
    return size * _FACTOR[kind](n) if n > 1 else 0.0


class WireMeter:
    """Counts the bytes of the current step; `last_step` holds the previous complete step, `total` all steps."""

    def __init__(self) -> None:
        self.current: dict[str, dict[str, float]] = defaultdict(lambda: {"sent": 0.0, "uncompressed": 0.0})
        self.last_step: dict[str, dict[str, float]] = {}
        self.total: dict[str, dict[str, float]] = defaultdict(lambda: {"sent": 0.0, "uncompressed": 0.0})

    def sent(self, dim: str, kind: str, buffer: Tensor | int, n: int) -> None:
        self.current[dim]["sent"] += wire_bytes(kind, buffer, n)

    def uncompressed(self, dim: str, kind: str, buffer: Tensor | int, n: int) -> None:
        self.current[dim]["uncompressed"] += wire_bytes(kind, buffer, n)

    def end_step(self) -> None:
        if not self.current:
            return
        self.last_step = {dim: dict(v) for dim, v in self.current.items()}
        for dim, v in self.current.items():
            for key, value in v.items():
                self.total[dim][key] += value
        self.current.clear()

    def metrics(self) -> dict[str, float]:
        """Loggable figures of the last complete step: bytes per dim and the compression ratio."""
        out: dict[str, float] = {}
        for dim, v in self.last_step.items():
            out[f"grad_compression/sent_bytes/{dim}"] = v["sent"]
            out[f"grad_compression/uncompressed_bytes/{dim}"] = v["uncompressed"]
        sent = sum(v["sent"] for v in self.last_step.values())
        if sent:
            out["grad_compression/ratio"] = sum(v["uncompressed"] for v in self.last_step.values()) / sent
        return out
