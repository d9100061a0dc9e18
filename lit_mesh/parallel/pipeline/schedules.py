"""The pipeline schedules lit-mesh offers, and what the user chose among them (`PipelineSettings`).

Data only: no process group, no model. lit_mesh/parallel/pipeline/rules.py judges the settings against pp and
the other options; the runners (runner.py, twobw.py) run them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from torch.distributed.pipelining import schedules as torch_schedules

from lit_mesh.errors import PipelineConfigError
from lit_mesh.parallel.pipeline.split import Placement
from lit_mesh.unit import option

# name -> (torch schedule class, stages per rank: "one", "many" or "two", placement of stages on ranks); None:
# lit-mesh's own driver (2bw: PipeDream-2BW, asynchronous, lit_mesh/parallel/pipeline/twobw.py)
SCHEDULES: dict[str, tuple[Optional[type], str, Placement]] = {
    "gpipe": (torch_schedules.ScheduleGPipe, "one", "loop"),
    "1f1b": (torch_schedules.Schedule1F1B, "one", "loop"),
    "interleaved_1f1b": (torch_schedules.ScheduleInterleaved1F1B, "many", "loop"),
    "looped_bfs": (torch_schedules.ScheduleLoopedBFS, "many", "loop"),
    "zero_bubble": (torch_schedules.ScheduleInterleavedZeroBubble, "many", "loop"),
    "zbv": (torch_schedules.ScheduleZBVZeroBubble, "two", "v"),
    "dualpipev": (torch_schedules.ScheduleDualPipeV, "two", "v"),
    "2bw": (None, "one", "loop"),
}

# the zero-bubble family: each backward runs in two parts, input gradients first (autograd with retain_graph) and
# weight gradients later; compiled or checkpointed blocks do not survive that (lit_mesh/parallel/pipeline/rules.py)
SPLIT_BACKWARD = frozenset({"zero_bubble", "zbv", "dualpipev"})


@dataclass(frozen=True)
class PipelineSettings:
    """What the user chose: schedule, micro-batches per step, stages per rank, optional blocks per stage."""

    schedule: str = option(
        "1f1b",
        doc='"gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble" (interleaved zero bubble), "zbv" or'
        ' "dualpipev" (V-shaped, 2 stages per rank); or "2bw" (PipeDream-2BW: asynchronous 1F1B without a flush, each'
        " batch's gradient applied one step late, two weight versions per stage; pp alone, see"
        " lit_mesh/parallel/pipeline/twobw.py).",
        arg="pp_schedule",
    )
    microbatches: Optional[int] = option(  # None: pp (one per stage rank)
        None,
        doc="micro-batches per step (must divide each pipeline replica's batch); default pp (dualpipev: 2 x pp, one"
        " per stage).",
        arg="pp_microbatches",
    )
    stages_per_rank: Optional[int] = option(  # None: 1, or 2 for the schedules that need several
        None,
        doc="virtual stages per rank for the interleaved schedules (default 2 there, else 1).",
        arg="pp_stages_per_rank",
    )
    split: Optional[tuple[int, ...]] = option(
        None,
        doc="blocks per stage, e.g. [3, 5]; default: balanced, counting embedding and head as one block each (an"
        " nn.Sequential without a plan: children per stage; default: balanced by parameter count).",
        arg="pp_split",
        accepts=Optional[list[int]],  # a tuple once checked (check_pipeline_settings)
    )

    @property
    def placement(self) -> Placement:
        return SCHEDULES[self.schedule][2]

    def local_stages(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if SCHEDULES[self.schedule][1] == "one" else 2

    def n_microbatches(self, pp: int) -> int:
        if self.microbatches is not None:
            return self.microbatches
        return max(pp, fewest_microbatches(self.schedule, pp, self.local_stages()))


def fewest_microbatches(schedule: str, pp: int, stages_per_rank: int) -> int:
    """The fewest micro-batches a schedule accepts: 1F1B one per stage, DualPipeV one per stage of its V; 2bw one per
    stage (each step's first backwards then finish the previous batch: at most two weight versions)."""
    return {"1f1b": pp, "2bw": pp, "dualpipev": pp * stages_per_rank}.get(schedule, 1)


_FEWER_MICROBATCHES = {"1f1b": "gpipe", "dualpipev": "zbv"}  # a schedule of the same shape that takes fewer


def microbatch_problem(settings: PipelineSettings, pp: int) -> Optional[str]:
    """Why torch's schedule refuses this many micro-batches at pp stage ranks (None: it accepts them), with counts
    that work; checked before any process starts (torch raises only inside the schedule's constructor)."""
    count, schedule = settings.n_microbatches(pp), settings.schedule
    fewest = fewest_microbatches(schedule, pp, settings.local_stages())
    if count < fewest:
        other = f", or use pp_schedule={_FEWER_MICROBATCHES[schedule]!r}" if schedule in _FEWER_MICROBATCHES else ""
        return f"needs at least {fewest} micro-batches (one per stage); set pp_microbatches >= {fewest}{other}"
    rounds = max(1, count // pp)  # the interleaved schedules run the micro-batches in rounds of pp
    if schedule in ("interleaved_1f1b", "zero_bubble") and count % rounds:
        return (
            f"runs micro-batches in {rounds} rounds of pp={pp} and {count} is not a multiple of {rounds}; set"
            f" pp_microbatches to a multiple of {pp}"
        )
    return None


def check_pipeline_settings(
    schedule: str, microbatches: Optional[int], stages_per_rank: Optional[int], split: Optional[Sequence[int]]
) -> PipelineSettings:
    """Each pipeline option on its own, in MeshStrategy.__init__ (with pp and each other: rules.py beside this)."""
    if schedule not in SCHEDULES:
        raise PipelineConfigError(f"pp_schedule={schedule!r} is not a schedule; choose one of {sorted(SCHEDULES)}")
    for name, value in (("pp_microbatches", microbatches), ("pp_stages_per_rank", stages_per_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PipelineConfigError(f"{name}={value!r} must be a positive int (or None for the default)")
    return PipelineSettings(schedule, microbatches, stages_per_rank, tuple(split) if split is not None else None)
