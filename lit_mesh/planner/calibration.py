"""The published runs of calibration.yaml, evaluated with the planner's one time model.

python -m lit_mesh.planner.calibration         # a table: published vs estimated tokens/s per device
python -m lit_mesh.planner.calibration --fit   # the kernel constants that fit the calibration runs best, and each
                                               # dropless router's routing_cv from its published pair
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import yaml

from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.cost import (
    CALIBRATION,
    Features,
    Kernels,
    Schedule,
    StepTime,
    calibrated_kernels,
    flops_per_token,
    step_time,
)
from lit_mesh.planner.families import family
from lit_mesh.planner.hardware import GB, GIB, Hardware
from lit_mesh.planner.memory import Workload, rank_memory
from lit_mesh.planner.pipeline_model import schedules_for
from lit_mesh.planner.shapes import ModelShapes, gpt_shapes
from lit_mesh.planner.vocabulary import AC_MODES

TOLERANCE = {"calibration": 0.20, "held-out": 0.25}


@dataclass(frozen=True)
class Check:
    name: str
    role: str
    published: float  # tokens/s per device
    estimated: float
    source: str

    @property
    def ratio(self) -> float:
        return self.estimated / self.published


@lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    return yaml.safe_load(CALIBRATION.read_text())


def runs() -> list[dict[str, Any]]:
    return _data()["runs"]


def hardware(name: str, devices: int) -> Hardware:
    h = _data()["hardware"][name]
    return Hardware(
        nodes=max(1, devices // h["devices_per_node"]),
        devices_per_node=min(devices, h["devices_per_node"]),
        memory_bytes=h["memory_gb"] * GB,
        peak_flops=h["peak_tflops"] * 1e12,
        memory_bandwidth=h["memory_tbps"] * 1e12,
        intra_node_bandwidth=h["intra_node_gbps"] * GB,
        inter_node_bandwidth=h["inter_node_gbps"] * GB,
        reserve_bytes=0 * GIB,
    )


@cache
def shapes_of(preset: str, model: str = "gpt") -> ModelShapes:
    """The shapes of a preset of a model family (the zoo's "gpt" Llama-3 presets, its "moe" Mixtral and DeepSeek)."""
    return gpt_shapes(family(model).config(preset))


def published_tokens_per_s(run: dict[str, Any], shapes: ModelShapes, hw: Hardware) -> float:
    """The run's tokens/s per device: as published, or from its MFU or TFLOP/s per device over the FLOPs per token
    the publisher counts: the zoo family's (attention scores counted dense), or with `flops_counted: causal` half of
    those attention FLOPs (Megatron-Core's count, lit_mesh/planner/calibration.yaml)."""
    if "tokens_per_s_per_device" in run:
        return float(run["tokens_per_s_per_device"])
    flops = run["tflops_per_device"] * 1e12 if "tflops_per_device" in run else run["mfu"] * hw.peak_flops
    return flops / published_flops_per_token(shapes, run["seq_len"], run.get("flops_counted", "dense"))


def published_flops_per_token(shapes: ModelShapes, seq_len: int, counted: str = "dense") -> float:
    """The FLOPs per token a publisher counts: the zoo family's, or ("causal") with half of the attention scores'
    and weighted values' 12 x layers x seq_len x heads x head_dim (a causal mask skips half of them)."""
    if counted not in ("dense", "causal"):
        raise ValueError(f"flops_counted={counted!r}: choose 'dense' or 'causal'")
    c = shapes.config
    skipped = 6.0 * c.n_layers * seq_len * c.n_heads * c.attention_head_dim if counted == "causal" else 0.0
    return flops_per_token(shapes, seq_len) - skipped


def planned_step(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    hw: Hardware,
    features: Features,
    kernels: Kernels | None = None,
) -> StepTime:
    """The planner's fastest fitting AC, micro-batch, schedule and way of sharing the experts over tp for a run's
    published degrees and features (a run that overlaps its all-to-alls keeps its schedule: the overlap is the
    schedule's)."""
    from lit_mesh.planner.search import expert_variants, micro_batches

    best: StepTime | None = None
    for variant, ac in itertools.product(expert_variants(shapes, layout, hw, features.ep_stride), AC_MODES):
        schedules = [features.schedule] if features.ep_overlap else schedules_for(layout.pp, variant.n_blocks, ac)
        for schedule in schedules:
            for micro in micro_batches(layout, work, schedule=schedule):
                w = dataclasses.replace(work, micro_batch=micro)
                if rank_memory(variant, layout, w, "bf16-mixed", ac, schedule=schedule)["total"] > hw.usable_bytes:
                    continue
                t = step_time(
                    variant, layout, w, "bf16-mixed", ac, hw, dataclasses.replace(features, schedule=schedule), kernels
                )
                if best is None or t.total < best.total:
                    best = t
    if best is None:
        raise ValueError(f"no AC, micro-batch or schedule fits {layout} in {hw.usable_bytes / GIB:.0f} GiB per device")
    return best


def check(run: dict[str, Any], kernels: Kernels | None = None) -> Check:
    routing = run.get("routing", "balanced")
    if routing not in ("balanced", "dropless"):
        raise ValueError(f"{run['name']}: routing {routing!r}: choose 'balanced' or 'dropless'")
    cv = routing_cv(run["preset"]) if routing == "dropless" else 0.0
    estimated = estimate(run, kernels, cv)
    shapes = shapes_of(run["preset"], run.get("model", "gpt"))
    hw = hardware(run["hardware"], MeshLayout(**run["layout"]).world_size)
    return Check(run["name"], run["role"], published_tokens_per_s(run, shapes, hw), estimated, run["source"])


def routing_cv(preset: str) -> float:
    """The preset's router unevenness (ModelShapes.routing_cv) as calibration.yaml's `routing` section states it."""
    routers = _data()["routing"]
    if preset not in routers:
        raise ValueError(f"a dropless run of {preset!r}: calibration.yaml's `routing` has no routing_cv for it")
    return float(routers[preset]["routing_cv"])


def estimate(run: dict[str, Any], kernels: Kernels | None = None, cv: float = 0.0) -> float:
    """The planner's tokens/s per device for a run's settings (its router's unevenness `cv`)."""
    shapes, layout = shapes_of(run["preset"], run.get("model", "gpt")), MeshLayout(**run["layout"])
    if run.get("expert_tp") == 1:  # whole experts, each tp rank routing its sequence shard (MoE parallel folding)
        shapes = shapes.with_whole_experts()
    shapes = shapes.with_routing_cv(cv)
    work = Workload(run["global_batch"], run["seq_len"], run["micro_batch"])
    hw = hardware(run["hardware"], layout.world_size)
    features = Features(
        compile=run["compile"],
        async_tp=run["async_tp"],
        schedule=Schedule(**run.get("schedule", {})),
        reshard_after_forward=run.get("reshard_after_forward", True),
        ep_overlap=run.get("ep_overlap", False),
        ep_stride=run.get("ep_stride"),
        routing_pass=run.get("routing_pass", True),
        float8=run.get("float8"),
    )
    if run.get("planned"):  # held out as `lit-mesh plan` would run it: only the degrees (and features) fixed
        t = planned_step(shapes, layout, work, hw, features, kernels)
    else:
        t = step_time(shapes, layout, work, "bf16-mixed", run["ac"], hw, features, kernels)
    return work.global_batch * work.seq_len / t.total / layout.world_size


def fit_routing_cv(preset: str) -> float:
    """The routing_cv at which the planner's dropless estimate of the preset's published pair (one run with forced
    balance, one dropless, nothing else changed) is slower than its balanced one by the published ratio."""
    pair = _data()["routing"][preset]["pair"]
    run = {"preset": preset, **pair}
    target = pair["balanced_tflops"] / pair["dropless_tflops"]  # the same FLOPs: the ratio of step times
    balanced = estimate(run)
    low, high = 0.0, 20.0
    for _ in range(40):  # bisection: the slowdown grows with the unevenness
        middle = (low + high) / 2
        low, high = (middle, high) if balanced / estimate(run, cv=middle) < target else (low, middle)
    return round((low + high) / 2, 2)


GRID = {
    "gemm_peak_fraction": (0.7, 0.75, 0.8, 0.85, 0.9),
    "gemm_half_size": (256, 384, 512, 768),
    "attention_peak_fraction": (0.3, 0.35, 0.4, 0.45),
    "elementwise_accesses": (60, 90, 120, 150),
    "elementwise_accesses_compiled": (20, 30, 45, 60),
}


FLOAT8_GRID = {
    "float8_gemm_peak_fraction": (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8),
    "float8_cast_accesses": (2, 4, 6, 8, 12, 16, 24),
    "float8_rowwise_cast_accesses": (8, 16, 24, 32, 48, 64, 96),
}


def _fit(grid: dict[str, tuple[float, ...]], calibration_runs: list[dict[str, Any]], base: Kernels) -> Kernels:
    """The grid point with the smallest worst error over `calibration_runs`."""
    best = None
    for values in itertools.product(*grid.values()):
        kernels = dataclasses.replace(base, **dict(zip(grid, values)))
        worst = max(abs(check(r, kernels).ratio - 1) for r in calibration_runs)
        if best is None or worst < best[0]:
            best = (worst, kernels)
    assert best is not None
    return best[1]


def fit_kernels() -> Kernels:
    """The bf16 constants on the calibration runs without float8, then the float8 ones on those with it, the bf16
    constants held (held-out runs take no part)."""
    calibration_runs = [r for r in runs() if r["role"] == "calibration"]
    bf16 = _fit(GRID, [r for r in calibration_runs if not r.get("float8")], calibrated_kernels())
    return _fit(FLOAT8_GRID, [r for r in calibration_runs if r.get("float8")], bf16)


if __name__ == "__main__":
    if "--fit" in sys.argv:
        print(fit_kernels())
        for preset in _data()["routing"]:
            print(f"{preset}: routing_cv {fit_routing_cv(preset)}")
    for c in map(check, runs()):
        print(
            f"{c.name:40s} {c.role:12s} published {c.published:8.1f}  estimated {c.estimated:8.1f}  {100 * (c.ratio - 1):+5.0f}%"
        )
