"""Every activation checkpointing x pipeline schedule x micro-batch option of one layout, and why the planner
rejected each one it does not run, with the numbers: the memory it needs against the budget by component, or
which count does not divide which."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.hardware import GB, Hardware
from lit_mesh.planner.memory import Workload, rank_memory
from lit_mesh.planner.pipeline_model import Schedule, schedules_for
from lit_mesh.planner.search import MAX_MICRO_BATCH, divisors, micro_batch_refused, why_not_zero_stage
from lit_mesh.planner.shapes import ModelShapes

MEMORY_PARTS = (("params", "params"), ("grads", "grads"), ("optimizer", "AdamW"), ("activations", "activations"))


@dataclass(frozen=True)
class Option:
    precision: str
    ac: str
    zero_stage: int
    schedule: Schedule
    micro_batch: int
    memory: dict[str, int] | None  # None: refused by divisibility, before any memory estimate
    rejected: str | None  # why it cannot run or does not fit; None: it fits

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "ac": self.ac,
            "zero_stage": self.zero_stage,
            "pp_schedule": self.schedule.name,
            "pp_stages_per_rank": self.schedule.stages_per_rank,
            "micro_batch": self.micro_batch,
            "memory": self.memory,
            "rejected": self.rejected,
        }


def sizes_to_show(local_batch: int) -> list[int]:
    """The micro-batches a table lists: every divisor of the local batch the search tries, and the powers of two
    up to it (the sizes a user would expect, shown refused when they do not divide)."""
    limit = min(local_batch, MAX_MICRO_BATCH)
    powers = (2**i for i in range(limit.bit_length()) if 2**i <= limit)
    return sorted({*(d for d in divisors(local_batch) if d <= MAX_MICRO_BATCH), *powers})


def over_memory(memory: dict[str, int], hw: Hardware, pp: int) -> str:
    """ "needs 97.3 GB of 75.7 GB: params 12.1, grads ..." (GB: 1e9 bytes, as --memory-gb)."""
    parts = ", ".join(f"{label} {memory[key] / GB:.1f}" for key, label in MEMORY_PARTS)
    where = f" (pp rank {memory['stage']})" if pp > 1 else ""
    return (
        f"needs {memory['total'] / GB:.1f} GB of {hw.usable_bytes / GB:.1f} GB usable: {parts}, FSDP buffers"
        f" {memory['buffers'] / GB:.1f}{where}"
    )


def layout_options(
    layout: MeshLayout,
    shapes: ModelShapes,
    work: Workload,
    hw: Hardware,
    precisions: Iterable[str],
    ac_modes: Iterable[str],
    zero_stages: Iterable[int],
) -> list[Option]:
    """Each option the search weighs for this layout (the ZeRO stages the layout allows), fitting or not."""
    out: list[Option] = []
    sizes = sizes_to_show(work.local_batch(layout))
    for zero_stage in zero_stages:
        if why_not_zero_stage(layout, zero_stage):
            continue
        for precision in precisions:
            for ac in ac_modes:
                for schedule in schedules_for(layout.pp, shapes.n_blocks, ac):
                    for micro in sizes:
                        option = partial(Option, precision, ac, zero_stage, schedule, micro)
                        if refused := micro_batch_refused(layout, work, micro, schedule):
                            out.append(option(None, refused))
                            continue
                        w = replace(work, micro_batch=micro)
                        memory = rank_memory(shapes, layout, w, precision, ac, zero_stage, schedule=schedule)
                        fits = memory["total"] <= hw.usable_bytes
                        out.append(option(memory, None if fits else over_memory(memory, hw, layout.pp)))
    return out


def rejection_table(options: list[Option], pp: int) -> list[str]:
    """The rejected options as lines of a compact table; the divisibility refusals that repeat over AC modes and
    schedules are one line each (their ACs and schedules listed; no schedule without pp)."""
    rejected = [o for o in options if o.rejected]
    several = {
        "precision": len({o.precision for o in options}) > 1,
        "zero": len({o.zero_stage for o in options}) > 1,
    }
    every_ac = {o.ac for o in options}
    every_schedule = {o.schedule.describe() for o in options}
    grouped: dict[tuple, list[Option]] = {}
    for o in rejected:
        key = (o.precision, o.zero_stage, o.micro_batch, o.rejected) if o.memory is None else (id(o),)
        grouped.setdefault(key, []).append(o)
    rows = []
    for group in grouped.values():
        first = group[0]
        acs = _listed([o.ac for o in group], every_ac)
        schedules = _listed([o.schedule.describe() for o in group], every_schedule) if pp > 1 else "-"
        prefix = (f"{first.precision:<11}" if several["precision"] else "") + (
            f"ZeRO-{first.zero_stage} " if several["zero"] else ""
        )
        rows.append(f"  {prefix}{acs:<10} {schedules:<22} {first.micro_batch:>4}  {first.rejected}")
    header = "  " + (f"{'precision':<11}" if several["precision"] else "") + ("ZeRO   " if several["zero"] else "")
    return [f"{header}{'AC':<10} {'schedule':<22} {'mb':>4}  why rejected", *rows]


def _listed(names: list[str], every: set[str]) -> str:
    """The names, or "any" when they are all there are."""
    return "any" if set(names) == every and len(every) > 1 else ",".join(dict.fromkeys(names))
