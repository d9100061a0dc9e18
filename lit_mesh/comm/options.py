"""The options of gradient compression and of the replicated reductions over the nodes.

What the user asks for: `MeshStrategy(grad_compression=...)` as a name or a typed options object, and how the
replicated reductions run over the nodes (`allreduce`, `topology`, `strict_topology`): CommunicationOptions.

Plain dataclasses, so LightningCLI YAML can give them:
    grad_compression: {mode: powersgd, powersgd_rank: 4, warmup_steps: 10}
Every check runs in MeshStrategy.__init__, in the user's process, before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Optional, Union

from lit_mesh.comm.codecs import ONEBIT_SCALES
from lit_mesh.comm.topology import Topology, as_topology
from lit_mesh.errors import CompressionConfigError, MeshConfigError  # noqa: F401 - re-exported
from lit_mesh.unit import option

MODES = ("fp16", "bf16", "powersgd", "onebit", "topk", "int8", "int4", "randomk", "threshold")
PHASE_MODES = ("none", *MODES)  # a phase of the schedule may also send uncompressed


@dataclass
class CompressionPhase:
    """A later phase of a compression schedule, with another mode.

    A later phase of training with another mode. It starts at `start_step`, or once the global norm of the
    reduced gradients changes by less than `grad_norm_change_below` (relative, step to step) for `patience`
    steps in a row, whichever comes first. Error-feedback residuals and PowerSGD factors carry over.
    """

    mode: str
    start_step: Optional[int] = None
    grad_norm_change_below: Optional[float] = None
    patience: int = 3


@dataclass
class CompressionOptions:
    """Gradient compression in every data-parallel reduction (FSDP reduce-scatter, DDP/HSDP all-reduce).

    mode: "fp16" / "bf16" (cast), "powersgd" (low rank), "onebit" (sign + scale), "topk" (largest entries),
        "int8" / "int4" (QSGD-style levels per block, stochastic rounding), "randomk" (entries drawn at random),
        "threshold" (entries at or above a magnitude). Codecs: lit_mesh/comm/codecs.py.
    powersgd_rank: rank of PowerSGD's factors P and Q.
    topk_ratio: fraction of entries top-k sends, in (0, 1].
    quant_block: entries sharing one fp32 scale in int8/int4 codes.
    randomk_ratio: fraction of entries random-k sends, in (0, 1].
    threshold: the magnitude at or above which "threshold" sends an entry.
    threshold_capacity: the most entries "threshold" sends, as a fraction in (0, 1]: its payload has that room.
    onebit_block: entries sharing one scale in 1-bit codes (the scale costs 32 bits per block).
    onebit_scale: the scale of a block of 1-bit codes: "rms" (its root mean square: the decoded gradient keeps
        the size that AdamW's second moment sees) or "mean_abs" (its mean |x|: the least squared error, for SGD).
    onebit_rms_refresh: 0: 1-bit codes decode to their block's scale. k > 0: every entry is first divided
        by its own running RMS (each rank's uncompressed gradients; shared as 8-bit log codes every k optimizer
        steps, 1/4 of an fp32 all-gather each time), so that after decoding every coordinate keeps its own size
        under AdamW (lit_mesh/comm/entry_scales.py). The defaults (block 256, RMS scales, refresh 32) send
        ~25x fewer bytes than fp32 and matched its loss under AdamW (benchmarks/README.md, "Gradient compression").
    intra_mode: the codec inside a node of the hierarchical all-reduce (allreduce="hierarchical" or "auto" across
        nodes: DDP, HSDP's replicate axis): e.g. "fp16" inside, `mode` (e.g. "onebit") between nodes; None: exact
        inside the node. Any mode but "powersgd", which needs whole matrices.
    warmup_steps: optimizer steps sent uncompressed before `mode` starts.
    bucket_mb: tensor fusion: pieces sent per tensor (PowerSGD factors, uncompressed 1-D tensors, lists
        given to the standalone API) are packed into buckets of up to this size, one collective each.
    error_feedback: keep what compression dropped, per rank, and add it to the next step's gradient.
    schedule: later phases (e.g. fp16 after warm-up, then 1-bit once the gradient norm settles).
    seed: seed of PowerSGD's first Q (the same on every rank) and of int8/int4 rounding and random-k draws
        (offset by the rank).
    """

    mode: str = "onebit"
    powersgd_rank: int = 4
    topk_ratio: float = 0.01
    quant_block: int = 256
    randomk_ratio: float = 0.01
    threshold: float = 1e-3
    threshold_capacity: float = 0.05
    onebit_block: int = 256
    onebit_scale: str = "rms"
    onebit_rms_refresh: int = 32
    intra_mode: Optional[str] = None
    warmup_steps: int = 0
    bucket_mb: float = 25.0
    error_feedback: bool = True
    schedule: list[CompressionPhase] = field(default_factory=list)
    seed: int = 0

    def phases(self) -> list[CompressionPhase]:
        """The whole timeline: uncompressed warm-up, then `mode`, then the schedule's phases."""
        timeline = [CompressionPhase("none", start_step=0)] if self.warmup_steps else []
        timeline.append(CompressionPhase(self.mode, start_step=self.warmup_steps))
        return timeline + list(self.schedule)


GradCompression = Union[str, CompressionOptions, None]


def _check_mode(mode: object, allowed: tuple[str, ...], what: str) -> None:
    if mode not in allowed:
        raise CompressionConfigError(
            f"{what}={mode!r} is not a compression mode; choose one of {', '.join(map(repr, allowed))}"
            + (" (or None for no compression)" if "none" not in allowed else "")
        )


def resolve_compression(value: GradCompression) -> Optional[CompressionOptions]:
    """A mode name or options -> checked options (None: no compression)."""
    if value is None or value == "none":
        return None
    if isinstance(value, dict):  # a plain mapping from Python code
        value = CompressionOptions(**value)
    if isinstance(value, str):
        _check_mode(value, MODES, "grad_compression")
        value = CompressionOptions(mode=value)
    if not isinstance(value, CompressionOptions):
        raise CompressionConfigError(
            f"grad_compression={value!r} must be a mode name ({', '.join(MODES)}), a CompressionOptions or None"
        )
    options = replace(value, schedule=[CompressionPhase(**s) if isinstance(s, dict) else s for s in value.schedule])
    check_options(options)
    return options


def check_options(o: CompressionOptions) -> None:
    """Refuse compression options out of range, naming the value and the fix."""
    _check_mode(o.mode, MODES, "grad_compression mode")
    if isinstance(o.powersgd_rank, bool) or not isinstance(o.powersgd_rank, int) or o.powersgd_rank < 1:
        raise CompressionConfigError(
            f"powersgd_rank={o.powersgd_rank!r} must be an int >= 1 (the rank of PowerSGD's factors; 4 is a good start)"
        )
    if not isinstance(o.topk_ratio, (int, float)) or not 0 < o.topk_ratio <= 1:
        raise CompressionConfigError(
            f"topk_ratio={o.topk_ratio!r} must be in (0, 1] (the fraction of gradient entries top-k sends, e.g. 0.01)"
        )
    for name, value in (("randomk_ratio", o.randomk_ratio), ("threshold_capacity", o.threshold_capacity)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise CompressionConfigError(
                f"{name}={value!r} must be in (0, 1] (a fraction of the gradient entries, e.g. 0.01)"
            )
    if isinstance(o.threshold, bool) or not isinstance(o.threshold, (int, float)) or not o.threshold > 0:
        raise CompressionConfigError(
            f"threshold={o.threshold!r} must be > 0 (the |gradient| at or above which an entry is sent)"
        )
    if isinstance(o.quant_block, bool) or not isinstance(o.quant_block, int) or o.quant_block < 1:
        raise CompressionConfigError(
            f"quant_block={o.quant_block!r} must be an int >= 1 (entries per int8/int4 scale, e.g. 256)"
        )
    if o.intra_mode is not None:
        _check_mode(o.intra_mode, tuple(m for m in MODES if m != "powersgd"), "grad_compression intra_mode")
        if o.mode == "powersgd":
            raise CompressionConfigError(
                f"intra_mode={o.intra_mode!r} with mode='powersgd': PowerSGD sums whole matrices inside the node before"
                " compressing them between nodes, so there is no node-local chunk to encode; use intra_mode=None"
            )
    if isinstance(o.warmup_steps, bool) or not isinstance(o.warmup_steps, int) or o.warmup_steps < 0:
        raise CompressionConfigError(
            f"warmup_steps={o.warmup_steps!r} must be an int >= 0 (optimizer steps sent uncompressed first; 0: none)"
        )
    if not isinstance(o.onebit_block, int) or o.onebit_block < 1:
        raise CompressionConfigError(f"onebit_block={o.onebit_block!r} must be an int >= 1 (entries per 1-bit scale)")
    if o.onebit_scale not in ONEBIT_SCALES:
        raise CompressionConfigError(
            f"onebit_scale={o.onebit_scale!r} must be one of {', '.join(map(repr, ONEBIT_SCALES))} (the scale of a"
            " block of 1-bit codes; 'rms' under Adam-type optimizers)"
        )
    if isinstance(o.onebit_rms_refresh, bool) or not isinstance(o.onebit_rms_refresh, int) or o.onebit_rms_refresh < 0:
        raise CompressionConfigError(
            f"onebit_rms_refresh={o.onebit_rms_refresh!r} must be an int >= 0 (optimizer steps between shares of the"
            " per-entry RMS scales of 1-bit codes, e.g. 16; 0: one scale per block only)"
        )
    if not isinstance(o.bucket_mb, (int, float)) or o.bucket_mb <= 0:
        raise CompressionConfigError(
            f"bucket_mb={o.bucket_mb!r} must be > 0 (tensor-fusion bucket size in MiB, e.g. 25)"
        )
    last_start = o.warmup_steps
    for i, phase in enumerate(o.schedule):
        where = f"grad_compression schedule[{i}]"
        _check_mode(phase.mode, PHASE_MODES, f"{where}.mode")
        if phase.start_step is None and phase.grad_norm_change_below is None:
            raise CompressionConfigError(
                f"{where} ({phase.mode!r}) has neither start_step nor grad_norm_change_below; give one of them"
            )
        if phase.start_step is not None:
            if phase.start_step < last_start:
                raise CompressionConfigError(
                    f"{where}.start_step={phase.start_step} comes before the phase before it (step {last_start});"
                    " list phases in the order they start"
                )
            last_start = phase.start_step
        if phase.grad_norm_change_below is not None and not phase.grad_norm_change_below > 0:
            raise CompressionConfigError(f"{where}.grad_norm_change_below={phase.grad_norm_change_below} must be > 0")
        if phase.patience < 1:
            raise CompressionConfigError(f"{where}.patience={phase.patience} must be >= 1")


AllReduceMode = Literal["auto", "flat", "hierarchical"]
ALLREDUCE_MODES = ("auto", "flat", "hierarchical")


def check_allreduce_mode(mode: str) -> None:
    """Refuse an `allreduce` mode that is not one of ALLREDUCE_MODES."""
    if mode not in ALLREDUCE_MODES:
        raise MeshConfigError(f"allreduce={mode!r}; choose one of {ALLREDUCE_MODES}")


@dataclass(frozen=True)
class CommunicationOptions:
    """The data-parallel gradient reductions: compressed or not, hierarchical or flat, on which topology."""

    compression: Optional[CompressionOptions] = option(
        None,
        doc='compress every data-parallel gradient reduction: "fp16", "bf16", "int8", "int4", "powersgd", "onebit",'
        ' "topk", "randomk", "threshold", or a `lit_mesh.CompressionOptions` (rank, ratio, warm-up, schedule, ...);'
        " None: off. See lit_mesh/comm/compression.py.",
        arg="grad_compression",
        accepts=GradCompression,
    )
    allreduce: AllReduceMode = option(
        "flat",
        doc='replicated gradients (DDP, HSDP\'s replicate axis) and metric reductions: "hierarchical" (reduce-scatter in'
        " the node, all-reduce of the 1/g piece between nodes, all-gather in the node; with grad_compression only the"
        " inter-node all-reduce is compressed), \"flat\" (NCCL's own all-reduce, FSDP2's native reduction without a"
        ' hook: NCCL already uses every rail, trees and NVLS), or "auto" (hierarchical where a model of NCCL on the'
        " topology predicts it faster, per tensor size). See lit_mesh/comm/allreduce_cost.py.",
    )
    # as given; the run's is read from the cluster environment at launch
    topology: Optional[Topology] = option(
        None,
        doc="nodes, devices per node and link bandwidths/latencies (`lit_mesh.Topology`); default: read from the"
        " cluster environment (SLURM, torchrun) and Trainer(num_nodes, devices). Given explicitly, it must agree"
        " with them (on one machine it may split the devices into simulated nodes).",
    )
    strict_topology: bool = option(
        False, doc="refuse a tensor-parallel group that would cross nodes (else: a warning with the numbers)."
    )

    def __post_init__(self) -> None:
        check_allreduce_mode(self.allreduce)
        # a mode name (or a mapping) -> checked CompressionOptions; a mapping of Topology fields -> Topology
        object.__setattr__(self, "compression", resolve_compression(self.compression))
        object.__setattr__(self, "topology", as_topology(self.topology))
