"""Pipeline schedules as the planner models them: which schedules it proposes, their bubble, how many stage
forwards each pp rank holds at its activation peak, and which blocks each pp rank runs.

The in-flight counts are read off torch's own schedule definitions (torch.distributed.pipelining.schedules,
checked against their `pipeline_order` in tests/unit/test_planner.py), with m = n // max(1, n // pp) the
micro-batches per round of the interleaved schedules, for pp rank r holding v stages:
- gpipe: every micro-batch, n;  1f1b: its warm-up plus one, min(pp - r, n);
- looped_bfs: every forward of every local stage, n v;
- interleaved_1f1b: warm-up (v - 1) m + 2 (pp - 1 - r) plus one, at most n v;
- zero_bubble (interleaved ZB1P): warm-up (v - 1) m + (pp - 1 - r) plus one, plus the r weight-gradient passes it
  defers (a stage's activations live until its weight gradient): (v - 1) m + pp, at most n v;
- zbv: min(n + 1 + r, 2n, 2 pp);  dualpipev: 2 pp + 1 (it needs n >= 2 pp).
One unit is one micro-batch through one stage of the rank. A rank's stages need not hold the same blocks (the split
gives the embedding's and the head's stages one block fewer): `held_blocks` weighs each held stage forward by its
stage's blocks at the peak, replaying the order of the interleaved schedules (whose ranks alternate their stages
every m micro-batches).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from lit_mesh.parallel.activation_checkpointing import checkpointed_in
from lit_mesh.parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD, PipelineSettings, microbatch_problem
from lit_mesh.parallel.pipeline.split import balanced_split, stage_ranks
from lit_mesh.parallel.regather import regathers_under
from lit_mesh.planner.vocabulary import ac_every, ac_mode

MAX_STAGES_PER_RANK = 8  # more virtual stages: smaller bubble, but v times the stage-boundary sends and warm-up


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule and the virtual stages each rank runs (lit_mesh.parallel.pipeline.schedules.SCHEDULES)."""

    name: str = "1f1b"
    stages_per_rank: int = 1

    def describe(self) -> str:
        return self.name if self.stages_per_rank == 1 else f"{self.name} v={self.stages_per_rank}"


ONE_F_ONE_B = Schedule()


def bubble_fraction(schedule: Schedule, pp: int, microbatches: int) -> float:
    """Idle time over busy time of a stage. With forward F, input-gradient B and weight-gradient W of one
    micro-batch each a third of F + B + W:
    - gpipe, 1f1b: (pp - 1) / n (Huang et al. 2019; Narayanan et al. 2021);
    - interleaved 1F1B / looped BFS with v stages per rank: (pp - 1) / (v n) (Narayanan et al. 2021);
    - zero bubble (ZB-H1, W deferred into the bubble): (pp - 1)(F + B - 2W) / (n (F + B + W)) = (pp - 1) / (3 n)
      (Qi et al. 2023), over v stages per rank for the interleaved form;
    - zbv / dualpipev (two stages per rank in a V): DualPipe's (pp/2 - 1)(F&B + B - 3W) with a full backward
      B + W and no credit for the F&B overlap: (pp - 2) / (3 n) (DeepSeek-V3 report, table 2).
    """
    if pp == 1:
        return 0.0
    n, v = microbatches, schedule.stages_per_rank
    if schedule.name in ("gpipe", "1f1b"):
        return (pp - 1) / n
    if schedule.name in ("interleaved_1f1b", "looped_bfs"):
        return (pp - 1) / (v * n)
    if schedule.name == "zero_bubble":
        return (pp - 1) / (3 * v * n)
    if schedule.name in ("zbv", "dualpipev"):
        return max(pp - 2, 0) / (3 * n)
    raise ValueError(
        f"schedule {schedule.name!r}: the planner knows gpipe, 1f1b, interleaved_1f1b, looped_bfs,"
        " zero_bubble, zbv, dualpipev"
    )


def in_flight(schedule: Schedule, pp: int, microbatches: int, rank: int) -> int:
    """Stage forwards (one micro-batch through one local stage) pp rank `rank` holds at its peak (module doc)."""
    n, v, name = microbatches, schedule.stages_per_rank, schedule.name
    if pp == 1:
        return 1  # gradient accumulation frees each micro-batch before the next
    per_round = n // max(1, n // pp)
    counts = {
        "gpipe": lambda: n,
        "1f1b": lambda: min(pp - rank, n),
        "looped_bfs": lambda: n * v,
        "interleaved_1f1b": lambda: min((v - 1) * per_round + 2 * (pp - 1 - rank) + 1, n * v),
        "zero_bubble": lambda: min((v - 1) * per_round + pp, n * v),
        "zbv": lambda: min(n + 1 + rank, 2 * n, 2 * pp),
        "dualpipev": lambda: 2 * pp + 1,
    }
    if name not in counts:
        raise ValueError(f"schedule {name!r}: the planner knows {sorted(counts)}")
    return counts[name]()


@lru_cache(maxsize=65536)  # the search asks for every rank of every option
def held_blocks(schedule: Schedule, pp: int, microbatches: int, rank: int, blocks: tuple[float, ...]) -> float:
    """Blocks' activations (one micro-batch through one block each) pp rank `rank`, whose local stages hold
    `blocks` (their block counts, or what one micro-batch through each keeps), keeps at its peak. Exact for gpipe,
    1f1b, looped_bfs and the interleaved 1F1B and zero-bubble schedules (their order replayed); zbv and dualpipev:
    their in-flight count times the larger stage (a bound)."""
    n, v = microbatches, schedule.stages_per_rank
    if pp == 1:
        return sum(blocks)  # one micro-batch through every block
    if schedule.name == "looped_bfs":
        return n * sum(blocks)
    if schedule.name in ("interleaved_1f1b", "zero_bubble") and v > 1:
        return _interleaved_peak(pp, n, rank, blocks, zero_bubble=schedule.name == "zero_bubble")
    return in_flight(schedule, pp, n, rank) * max(blocks)


def _interleaved_order(pp: int, n: int, rank: int, v: int, zero_bubble: bool) -> Iterator[tuple[str, int]]:
    """torch's interleaved order for one rank (schedules._get_1f1b_rank_ops; our replay, checked against torch's
    pipeline_order in tests/unit/test_planner.py), as (action, local stage): "F" forwards of stage (op // m) mod v,
    "B" backwards of stage v - 1 - ((op - warm-up) // m) mod v (zero bubble: input gradients only), and under zero
    bubble "W" weight-gradient passes, deferred until the rank's (rank + 1)-th backward."""
    m = n // max(1, n // pp)
    warmup = min((v - 1) * m + (1 if zero_bubble else 2) * (pp - 1 - rank), n * v)
    awaiting_weights: list[int] = []
    for op in range(n * v + warmup):
        if op < n * v:
            yield "F", (op // m) % v
        if op >= warmup:
            stage = v - 1 - ((op - warmup) // m) % v
            yield "B", stage
            if zero_bubble:
                awaiting_weights.append(stage)
                if op - warmup >= rank:  # torch's num_1f1b_microbatches = rank: then one weight pass per backward
                    yield "W", awaiting_weights.pop(0)
    for stage in awaiting_weights:
        yield "W", stage


def _interleaved_peak(pp: int, n: int, rank: int, blocks: tuple[float, ...], zero_bubble: bool) -> float:
    """A stage forward's activations live until its full backward, or under zero bubble its weight-gradient pass."""
    held = peak = 0.0
    for action, stage in _interleaved_order(pp, n, rank, len(blocks), zero_bubble):
        if action == "F":
            held += blocks[stage]
            peak = max(peak, held)
        elif action == ("W" if zero_bubble else "B"):
            held -= blocks[stage]
    return peak


def gradients_exact(schedule: Schedule) -> bool:
    """Whether held_gradients replays the schedule (else it bounds it)."""
    return schedule.stages_per_rank == 1 or schedule.name in ("interleaved_1f1b", "zero_bubble")


@lru_cache(maxsize=65536)
def held_gradients(schedule: Schedule, pp: int, microbatches: int, rank: int, sizes: tuple[int, ...]) -> int:
    """The most of `sizes` (one per local stage: its unsharded gradients) pp rank `rank` holds at once: a stage's
    gradients live from its first gradient pass (full backward, or weight pass) to its last, after which torch's
    schedule reduces them (schedules._add_reduce_grad). Exact for one stage per rank and the interleaved 1F1B and
    zero-bubble schedules (replayed); the other multi-stage schedules: every stage's at once (a bound)."""
    v = len(sizes)
    if v == 1:
        return sizes[0]
    if not gradients_exact(schedule):
        return sum(sizes)
    zero_bubble = schedule.name == "zero_bubble"
    kind = "W" if zero_bubble else "B"
    passes = [stage for action, stage in _interleaved_order(pp, microbatches, rank, v, zero_bubble) if action == kind]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, stage in enumerate(passes):
        first.setdefault(stage, i)
        last[stage] = i
    change = [0] * (len(passes) + 1)  # alive from its first pass through its last
    for stage, i in first.items():
        change[i] += sizes[stage]
        change[last[stage] + 1] -= sizes[stage]
    alive = peak = 0
    for delta in change:
        alive += delta
        peak = max(peak, alive)
    return peak


@dataclass(frozen=True)
class RankStages:
    """What pp rank r runs: the blocks of each of its stages, and whether it holds the embedding / the head."""

    blocks: tuple[int, ...]  # per local stage
    first: bool
    last: bool
    starts: tuple[int, ...] = ()  # per local stage: the model index of its first block

    def checkpointed(self, ac: str) -> tuple[int, ...]:
        """Per local stage, how many of its blocks AC mode `ac` checkpoints (by their index in the model)."""
        return _checkpointed(self.starts, self.blocks, ac)

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks)


@lru_cache(maxsize=65536)  # the search asks for every rank of every option
def _checkpointed(starts: tuple[int, ...], blocks: tuple[int, ...], ac: str) -> tuple[int, ...]:
    if ac_mode(ac) == "none":
        return (0,) * len(blocks)
    every = ac_every(ac)
    return tuple(checkpointed_in(start, n, every) for start, n in zip(starts, blocks, strict=True))


def checkpointed_share(n_blocks: int, ac: str) -> float:
    """The share of the model's blocks AC mode `ac` checkpoints ("full/2": every 2nd)."""
    return 0.0 if ac_mode(ac) == "none" else checkpointed_in(0, n_blocks, ac_every(ac)) / n_blocks


@lru_cache(maxsize=4096)
def rank_stages(n_blocks: int, pp: int, schedule: Schedule = ONE_F_ONE_B) -> tuple[RankStages, ...]:
    """Each pp rank's stages under lit_mesh's balanced split of pp x v stages and the schedule's placement
    (looped: stage s on rank s mod pp, the head on rank pp - 1; V: rank r runs r and 2pp - 1 - r, the head on 0)."""
    n_stages = pp * schedule.stages_per_rank
    split = balanced_split(n_blocks, n_stages)
    starts = [sum(split[:s]) for s in range(n_stages)]
    owner = stage_ranks(n_stages, pp, SCHEDULES[schedule.name][2])
    return tuple(
        RankStages(
            tuple(split[s] for s in range(n_stages) if owner[s] == r),
            owner[0] == r,
            owner[-1] == r,
            tuple(starts[s] for s in range(n_stages) if owner[s] == r),
        )
        for r in range(pp)
    )


def schedules_for(pp: int, n_blocks: int, ac: str) -> list[Schedule]:
    """The schedules the search tries at pp stage ranks: 1f1b; interleaved_1f1b and zero_bubble with v = 2, and
    every larger v up to MAX_STAGES_PER_RANK whose pp x v stages divide the blocks evenly, or the blocks with the
    embedding and the head counted as one block each (the split gives their stages one block fewer: Llama 3 405B's
    126 blocks in 64 stages); zbv and dualpipev.
    gpipe and looped_bfs are left out: the bubble of their 1F1B counterparts, with every micro-batch in flight.
    The split-backward schedules only without activation checkpointing (rules.split_backward_without_block_options;
    the planner proposes no compiled blocks)."""
    if pp == 1:
        return [ONE_F_ONE_B]
    out = [ONE_F_ONE_B]
    for v in range(2, MAX_STAGES_PER_RANK + 1):
        if pp * v <= n_blocks and (v == 2 or n_blocks % (pp * v) == 0 or (n_blocks + 2) % (pp * v) == 0):
            out += [Schedule("interleaved_1f1b", v), Schedule("zero_bubble", v)]
    if 2 * pp <= n_blocks:
        out += [Schedule("zbv", 2), Schedule("dualpipev", 2)]
    return [s for s in out if ac == "none" or s.name not in SPLIT_BACKWARD]


def regathers(schedule: Schedule, pp: int) -> bool:
    """Whether blocks without AC re-gather their sequence-parallel inputs in backward (MeshStrategy's own rule)."""
    return regathers_under(schedule.name, pp)


def microbatches_refused(schedule: Schedule, pp: int, microbatches: int) -> str | None:
    """Why MeshStrategy would refuse this many micro-batches with this schedule (its own rule), or None."""
    if pp == 1:
        return None
    return microbatch_problem(PipelineSettings(schedule.name, microbatches, schedule.stages_per_rank), pp)
