"""Enumerate every mesh (pp, dp_replicate, dp_shard, cp, tp) x activation checkpointing x precision for a world
size, keep the ones lit_mesh can run and whose per-rank memory fits, and rank them by estimated step time.
With pp > 1 each option takes its fastest fitting pipeline schedule (lit_mesh.planner.pipeline_model.schedules_for:
1F1B, interleaved and zero-bubble with v stages per rank, ZBV, DualPipeV) and micro-batch count.

For an MoE model every ep that divides dp_shard x cp (ep borrows those ranks) is tried as well.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.cost import (
    Features,
    StepTime,
    calibrated_kernels,
    ep_nodes_spanned,
    model_flops_per_step,
    step_time,
)
from lit_mesh.planner.hardware import GIB, Hardware
from lit_mesh.planner.memory import Workload, expert_fsdp_degree, expert_fsdp_dim, rank_memory
from lit_mesh.planner.pipeline_model import (
    ONE_F_ONE_B,
    Schedule,
    checkpointed_share,
    microbatches_refused,
    schedules_for,
)
from lit_mesh.planner.shapes import ModelShapes
from lit_mesh.planner.vocabulary import AC_MODES, DIMS, FLOAT8_RECIPES, PRECISION_BYTES, ac_mode


@dataclass
class Candidate:
    layout: MeshLayout
    precision: str
    ac: str
    work: Workload  # with the micro-batch chosen
    memory: dict[str, int]
    time: StepTime
    tokens_per_s: float
    mfu: float
    reasons: list[str] = field(default_factory=list)
    zero_stage: int = 3  # what the data-parallel shard dim shards (lit_mesh/parallel/data.py)
    schedule: Schedule = ONE_F_ONE_B  # the pipeline schedule (pp > 1)
    float8: str | None = None  # MeshStrategy(float8=...): the blocks' linears in float8 (torchao)
    whole_experts: bool = False  # MeshStrategy(expert_tp=1): whole experts, each tp rank routing its sequence shard
    ep_nodes: int = 1  # MeshStrategy(ep_dispatch="by_node"): the nodes an ep group spans (1: the all-to-all dispatch)

    def fits(self, hw: Hardware) -> bool:
        return self.memory["total"] <= hw.usable_bytes

    def name(self) -> str:
        degrees = (
            " x ".join(f"{d}={getattr(self.layout, d)}" for d in DIMS if getattr(self.layout, d) > 1) or "one device"
        )
        if self.layout.ep > 1:
            degrees += f" (ep={self.layout.ep} of dp_shard x cp{' x tp' if self.whole_experts else ''})"
        zero = f", ZeRO-{self.zero_stage}" if self.zero_stage < 3 else ""
        schedule = f", {self.schedule.describe()}" if self.layout.pp > 1 else ""
        float8 = f", float8 {self.float8}" if self.float8 else ""
        if self.whole_experts:
            degrees += ", whole experts (expert_tp=1)"
        if self.ep_nodes > 1:
            degrees += f", tokens once per node (ep_dispatch=by_node, {self.ep_nodes} nodes)"
        return f"{degrees}{schedule}{zero}, {self.precision}{float8}, AC {self.ac}, micro-batch {self.work.micro_batch}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(world: int) -> Iterable[MeshLayout]:
    for pp in divisors(world):
        for tp in divisors(world // pp):
            for cp in divisors(world // pp // tp):
                dp = world // pp // tp // cp
                for replicate in divisors(dp):
                    yield MeshLayout(pp=pp, dp_replicate=replicate, dp_shard=dp // replicate, cp=cp, tp=tp)


def with_expert_parallel(layouts: Iterable[MeshLayout], shapes: ModelShapes) -> Iterable[MeshLayout]:
    """Each layout with every ep it can borrow from dp_shard x cp x tp (tp ranks: whole experts under tp only; a
    dense model: ep = 1 only)."""
    for layout in layouts:
        yield layout
        if shapes.is_moe:
            for ep in divisors(layout.dp_shard * layout.cp * layout.tp)[1:]:
                yield replace(layout, ep=ep)


def why_invalid(layout: MeshLayout, shapes: ModelShapes, work: Workload, hw: Hardware) -> str | None:
    """The first reason lit_mesh could not run this layout (or would run it badly), or None."""
    for what, size in shapes.ep_divides.items():
        if size % layout.ep:
            return f"ep must divide {what}={size}"
    if hw.devices_per_node % layout.tp:
        return f"tp must divide the {hw.devices_per_node} devices of a node (tensor parallel stays on NVLink)"
    for what, size in shapes.tp_divides.items():
        if size % layout.tp:
            return f"tp must divide {what}={size}"
    expert_dp = expert_fsdp_degree(shapes, layout)
    for p in shapes.block:
        dim = expert_fsdp_dim(p, layout.tp)
        if p.expert and expert_dp > 1 and p.shape[dim] % expert_dp:  # FSDP2 refuses uneven shards off dim 0
            over = "dp_shard x cp x tp / ep" if shapes.whole_experts else "dp_shard x cp / ep"
            return (
                f"{over} must divide the expert weights' dim {dim} ({p.name}: {p.shape[dim]}): FSDP2"
                f" shards them on dim {dim}, evenly only"
            )
    if layout.pp > 1 and getattr(shapes.config, "tie_embeddings", False):
        # MeshStrategy trains it (a copy of the matrix on the first and the last stage); the memory model does not
        return "pp with tied embeddings is not modelled by the planner (each end stage holds a copy of the matrix)"
    if layout.pp > shapes.n_blocks:
        return f"pp must not exceed the {shapes.n_blocks} blocks"
    if work.global_batch % layout.dp:
        return f"dp must divide the global batch of {work.global_batch} sequences"
    if layout.pp > 1 and work.local_batch(layout) < layout.pp:
        return "the pipeline needs at least pp micro-batches (sequences per data-parallel rank)"
    if work.seq_len % (2 * layout.cp) and layout.cp > 1:
        return "cp (ring, load-balanced) needs the sequence length divisible by 2 x cp"
    if (work.seq_len // layout.cp) % layout.tp:
        return "sequence parallel needs each rank's sequence length divisible by tp"
    return None


def why_wasteful(layout: MeshLayout, shapes: ModelShapes, work: Workload, hw: Hardware) -> str | None:
    """The first reason a runnable layout is not worth proposing, or None."""
    if layout.cp > 1 and work.seq_len // layout.cp < (need := cp_min_tokens(shapes, layout, hw)):
        return (
            f"cp would leave fewer than {need} tokens per rank: the ring's K/V exchange would outlast the"
            " attention it hides behind (the sequence is too short to need cp)"
        )
    return None


def cp_min_tokens(shapes: ModelShapes, layout: MeshLayout, hw: Hardware) -> int:
    """The fewest tokens per rank for which context parallelism pays: the ring hides each K/V block's send behind
    the attention on the previous block only if t = seq_len / cp satisfies
        attention of a step, 4 t^2 head_dim heads / tp / (peak x eff)  >=  send, 2 t head_dim kv_heads act / tp / bw
    i.e. t >= kv_heads act peak eff / (2 heads bw): about 1,700 tokens for Llama 3 GQA over a 50 GB/s network,
    200 over NVLink. Below it cp adds exposed communication and shrinks every kernel: plain FSDP is better.
    At least 512 tokens per rank anyway (four 128-token flash-attention tiles in each load-balanced half)."""
    c, act = shapes.config, 2  # bf16 K/V
    bandwidth = hw.link(layout.tp, layout.cp)[0]
    overlap = (
        c.n_kv_heads * act * hw.peak_flops * calibrated_kernels().attention_peak_fraction / (2 * c.n_heads * bandwidth)
    )
    return max(512, math.ceil(overlap))


def why_not_zero_stage(layout: MeshLayout, zero_stage: int) -> str | None:
    """MeshStrategy's rules for zero_stage < 3 (lit_mesh/rules.py)."""
    if zero_stage < 3 and layout.dp_shard * layout.cp == 1:
        return "ZeRO-1/2 need a sharded data-parallel dim (dp_shard x cp > 1)"
    if zero_stage < 3 and layout.pp > 1:
        return "ZeRO-1/2 with pp: the pipeline already gathers once per step (MeshStrategy refuses zero_stage there)"
    return None


def evaluate(
    layout: MeshLayout,
    shapes: ModelShapes,
    work: Workload,
    hw: Hardware,
    precision: str,
    ac: str,
    zero_stage: int = 3,
    *,
    schedule: Schedule = ONE_F_ONE_B,
    memory: dict[str, int] | None = None,
    float8: str | None = None,
) -> Candidate:
    """`memory`: rank_memory's answer for these arguments, where the caller already has it (under float8: bf16's,
    as a real step counts it; docs/techniques/planner.md)."""
    if memory is None:
        memory = rank_memory(shapes, layout, work, precision, ac, zero_stage, schedule=schedule)
    features = Features(zero_stage=zero_stage, schedule=schedule, float8=float8)
    time = step_time(shapes, layout, work, precision, ac, hw, features)
    tokens = work.global_batch * work.seq_len
    mfu = model_flops_per_step(shapes, work) / (time.total * layout.world_size * hw.peak_flops)
    return Candidate(
        layout,
        precision,
        ac,
        work,
        memory,
        time,
        tokens / time.total,
        mfu,
        zero_stage=zero_stage,
        schedule=schedule,
        float8=float8,
        whole_experts=shapes.whole_experts,
        ep_nodes=shapes.ep_nodes,
    )


MAX_MICRO_BATCH = 32


def micro_batch_refused(layout: MeshLayout, work: Workload, micro: int, schedule: Schedule = ONE_F_ONE_B) -> str | None:
    """Why `micro` sequences per micro-batch cannot run on this layout with this schedule (which number does not
    divide which, or MeshStrategy's own rule for the schedule: pp_microbatches_for_schedule), or None."""
    local = work.local_batch(layout)
    if local % micro:
        return (
            f"micro-batch {micro} does not divide the {local} sequences per data-parallel rank (global batch"
            f" {work.global_batch} / dp={layout.dp})"
        )
    count = local // micro
    if layout.pp > 1 and count < layout.pp:
        plural = "micro-batch" if count == 1 else "micro-batches"
        return f"{local} / {micro} = {count} {plural}, fewer than the pp={layout.pp} stages"
    if refused := microbatches_refused(schedule, layout.pp, count):
        return f"{schedule.describe()} with {count} micro-batches: {refused}"
    return None


def micro_batches(layout: MeshLayout, work: Workload, *, schedule: Schedule = ONE_F_ONE_B) -> list[int]:
    """Sequences per micro-batch to try, largest first: divisors of the local batch up to MAX_MICRO_BATCH that
    micro_batch_refused accepts."""
    sizes = [m for m in divisors(work.local_batch(layout)) if m <= MAX_MICRO_BATCH]
    return sorted((m for m in sizes if micro_batch_refused(layout, work, m, schedule) is None), reverse=True)


def best_option(
    layout: MeshLayout,
    shapes: ModelShapes,
    work: Workload,
    hw: Hardware,
    precision: str,
    ac: str,
    zero_stage: int = 3,
    float8: str | None = None,
) -> tuple[Candidate | None, Candidate]:
    """(the fastest fitting (schedule, micro-batch size) or None, the least-memory one)."""
    fitting: list[Candidate] = []
    smallest = None
    for schedule in schedules_for(layout.pp, shapes.n_blocks, ac):
        for micro in micro_batches(layout, work, schedule=schedule):
            w = replace(work, micro_batch=micro)
            memory = rank_memory(shapes, layout, w, precision, ac, zero_stage, schedule=schedule)
            if memory["total"] <= hw.usable_bytes:
                fitting.append(
                    evaluate(
                        layout,
                        shapes,
                        w,
                        hw,
                        precision,
                        ac,
                        zero_stage,
                        schedule=schedule,
                        memory=memory,
                        float8=float8,
                    )
                )
            elif smallest is None or memory["total"] < smallest[1]:
                smallest = (w, memory["total"], schedule)
    if fitting:
        best = min(fitting, key=lambda c: c.time.total)
        return best, min(fitting, key=lambda c: c.memory["total"])
    assert smallest is not None
    return None, evaluate(
        layout, shapes, smallest[0], hw, precision, ac, zero_stage, schedule=smallest[2], float8=float8
    )


@dataclass
class PlanResult:
    ranked: list[Candidate]  # valid and fitting, fastest first
    rejected: Counter  # reason -> number of (layout, precision, AC) options
    smallest: Candidate | None  # the valid option with the least memory (what to show when nothing fits)
    considered: int


def plan(
    shapes: ModelShapes,
    work: Workload,
    hw: Hardware,
    precisions: Iterable[str] = ("bf16-mixed",),
    ac_modes: Iterable[str] = AC_MODES,
    fixed: Mapping[str, int] | None = None,
    zero_stages: Iterable[int] = (3,),
    float8: str | None = None,
) -> PlanResult:
    """zero_stages: the ZeRO stages to search (3: FSDP, the default; 1 and 2 gather less, hold more). float8: the
    recipe of MeshStrategy(float8=...) the run uses (None: bf16 linears)."""
    precisions, ac_modes, fixed, zero_stages = tuple(precisions), tuple(ac_modes), dict(fixed or {}), tuple(zero_stages)
    for p in precisions:
        if p not in PRECISION_BYTES:
            raise ValueError(f"precision {p!r}; choose from {sorted(PRECISION_BYTES)}")
    for a in ac_modes:
        if a not in AC_MODES:
            raise ValueError(f"activation checkpointing {a!r}; choose from {AC_MODES}")
    if float8 is not None and float8 not in FLOAT8_RECIPES:
        raise ValueError(f"float8 {float8!r}; choose from {FLOAT8_RECIPES}")
    rejected: Counter = Counter()
    ranked: list[Candidate] = []
    smallest: Candidate | None = None
    considered = 0
    for layout in with_expert_parallel(factorisations(hw.world_size), shapes):
        if any(getattr(layout, d) != v for d, v in fixed.items()):
            continue
        options = len(precisions) * len(ac_modes)
        for variant in expert_variants(shapes, layout, hw):
            considered += options * len(zero_stages)
            reason = why_invalid(layout, variant, work, hw) or why_wasteful(layout, variant, work, hw)
            if reason:
                rejected[reason] += options * len(zero_stages)
                continue
            for zero_stage in zero_stages:
                if reason := why_not_zero_stage(layout, zero_stage):
                    rejected[reason] += options
                    continue
                for precision in precisions:
                    for ac in ac_modes:
                        best, least = best_option(layout, variant, work, hw, precision, ac, zero_stage, float8)
                        if smallest is None or least.memory["total"] < smallest.memory["total"]:
                            smallest = least
                        if best is not None:
                            ranked.append(best)
                        else:
                            rejected[f"over {hw.usable_bytes / GIB:.1f} GiB per device (memory minus reserve)"] += 1
    ranked = rank(ranked)
    for c in ranked:
        c.reasons = explain(c, shapes_of(c, shapes), work, hw)
    if smallest is not None:
        smallest.reasons = explain(smallest, shapes_of(smallest, shapes), work, hw)
    return PlanResult(ranked, rejected, smallest, considered)


def expert_variants(
    shapes: ModelShapes, layout: MeshLayout, hw: Hardware, ep_stride: int | None = None
) -> list[ModelShapes]:
    """The ways the tp ranks can share an MoE model's experts: split over tp (expert_tp=None; ep from dp_shard x cp),
    and under tp > 1 whole (expert_tp=1, each tp rank routing its sequence shard; ep from dp_shard x cp x tp). Where
    an ep group spans nodes, with its tokens sent once per node (ep_dispatch="by_node") instead of the all-to-all:
    fewer bytes over the slower links (its all-to-all time is within 3% of the all-to-all dispatch's where it saves
    nothing, tests/unit/test_planner_moe_time.py), and half the options to price."""
    if shapes.whole_experts:  # a run that fixed expert_tp=1 (a calibration row)
        ways = [shapes]
    else:
        ways = [shapes] if (layout.dp_shard * layout.cp) % layout.ep == 0 else []
        ways += [shapes.with_whole_experts()] if shapes.is_moe and layout.tp > 1 else []
    return [way.with_ep_nodes(ep_nodes_spanned(way, layout, hw, ep_stride)) for way in ways]


def shapes_of(c: Candidate, shapes: ModelShapes) -> ModelShapes:
    """The shapes a candidate was evaluated with."""
    return (shapes.with_whole_experts() if c.whole_experts else shapes).with_ep_nodes(c.ep_nodes)


TIE = 0.02  # step times this close are a tie: well inside the time model's error on published runs (up to 7%)


def parallel_dims(c: Candidate) -> int:
    return sum(getattr(c.layout, d) > 1 for d in (*DIMS, "ep"))


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest first; among options within TIE of the fastest of their group: less exposed communication (in
    steps of 1% of the step time), then
    fewer parallel dims (simpler to run and debug), then less memory."""
    by_time = sorted(candidates, key=lambda c: c.time.total)
    ranked: list[Candidate] = []
    while by_time:
        lead = by_time[0].time.total
        tied = [c for c in by_time if c.time.total <= lead * (1 + TIE)]
        by_time = by_time[len(tied) :]
        # exposed communication in steps of 1% of the step: smaller differences are noise of the model too
        ranked += sorted(
            tied, key=lambda c: (round(100 * sum(c.time.exposed.values()) / lead), parallel_dims(c), c.memory["total"])
        )
    return ranked


def _gib(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB (tiny models are planned too)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _s(t: float) -> str:
    return f"{t:.3f} s" if t >= 0.1 else f"{1e3 * t:.3f} ms"


def explain(c: Candidate, shapes: ModelShapes, work: Workload, hw: Hardware) -> list[str]:
    """Why this option: memory against the budget, where the time goes, and what each dim buys."""
    m, t, layout = c.memory, c.time, c.layout
    out = [
        f"memory {_gib(m['total'])} of {_gib(hw.usable_bytes)} usable (worst stage {m['stage']}): params"
        f" {_gib(m['params'])}, grads {_gib(m['grads'])}, AdamW {_gib(m['optimizer'])}, activations"
        f" {_gib(m['activations'])}, FSDP buffers {_gib(m['buffers'])}",
        f"step {_s(t.total)}: compute {_s(t.compute)} ("
        + ", ".join(f"{k} {_s(v)}" for k, v in t.compute_parts.items() if v)
        + ")"
        + "".join(f", {k} {_s(v)} exposed" for k, v in t.exposed.items())
        + (f", pipeline bubble +{100 * t.bubble:.0f}%" if t.bubble else "")
        + f", AdamW {_s(t.optimizer)}; {c.tokens_per_s:,.0f} tokens/s, MFU {100 * c.mfu:.0f}%",
    ]
    for k, v in t.overlapped.items():
        out.append(f"{k} traffic {_s(v)}, {_s(t.exposed.get(k, 0.0))} of it exposed (the rest overlaps compute)")
    if layout.ep > 1:
        out.append(
            f"ep={layout.ep}: {shapes.config.n_experts // layout.ep} of {shapes.config.n_experts} experts per rank,"
            f" tokens to their experts by all-to-all ({_s(t.exposed['ep'])} exposed)"
            + (
                f"; once per node between the {shapes.ep_nodes} nodes of an ep group ({shapes.nodes_per_token:.1f} of"
                f" {shapes.config.top_k} copies per token), forwarded inside the node (ep_dispatch=by_node)"
                if shapes.ep_nodes > 1
                else ""
            )
        )
        imbalance = shapes.routing_imbalance(layout.ep, layout.tp, layout.cp, c.work.micro_batch)
        if imbalance > 1:
            out.append(
                f"dropless routing (routing_cv {shapes.routing_cv:g}): the busiest ep rank receives {imbalance:.2f}x"
                " its share of the routed copies, and the step waits for its experts and all-to-alls; larger"
                " micro-batches or more ranks' sequences per ep group even it out"
            )
    if layout.tp > 1:
        out.append(
            f"tp={layout.tp} inside a node: weights and activations / {layout.tp}, collectives on NVLink"
            + (", each expert's hidden units split over tp" if shapes.expert_tp else "")
            + (
                ", whole experts: each tp rank routes its own sequence shard (expert_tp=1)"
                if shapes.whole_experts
                else ""
            )
        )
    if c.zero_stage < 3:
        out.append(
            f"ZeRO-{c.zero_stage}: parameters gathered once per step and kept until backward ends (buffers),"
            + (" gradients reduced once per step" if c.zero_stage == 1 else " gradients reduce-scattered")
        )
    if layout.dp_replicate > 1:
        out.append(
            f"HSDP: shards over {layout.dp_shard * layout.cp} ranks, replicas all-reduce across"
            f" {layout.dp_replicate} groups (less inter-node traffic than sharding over all)"
        )
    if layout.cp > 1:
        out.append(f"cp={layout.cp}: each rank holds {work.seq_len // layout.cp} of {work.seq_len} tokens per sequence")
    if layout.pp > 1:
        v = c.schedule.stages_per_rank
        stages = f", {v} stages per rank ({layout.pp * v} in all)" if v > 1 else ""
        out.append(
            f"pp={layout.pp}, schedule {c.schedule.name}{stages}: {c.work.microbatches(layout)} micro-batches"
            f" of {c.work.micro_batch} per step, bubble {100 * t.bubble:.1f}%; stages exchange activations of"
            f" ({c.work.micro_batch}, {work.seq_len // (layout.cp * layout.tp)}, {shapes.config.dim}) per rank"
            " (micro-batch, T / cp / tp under sequence parallelism, dim)"
            + (
                f", MoE routing pass {_s(t.compute_parts['routing_pass'])} (the step's expert load before the schedule)"
                if "routing_pass" in t.compute_parts
                else ""
            )
        )
    elif c.work.microbatches(layout) > 1:
        out.append(
            f"gradient accumulation: {c.work.microbatches(layout)} micro-batches of {c.work.micro_batch}"
            " sequences per step (the whole local batch would not fit)"
        )
    if c.ac != "none":
        share = checkpointed_share(shapes.n_blocks, c.ac)  # "full/2": every 2nd block recomputed
        extra = f"+{33 * share:.0f}% compute" if ac_mode(c.ac) == "full" else "no extra matmuls"
        out.append(f"AC {c.ac}: activations {_gib(m['activations'])} ({extra})")
    return out
