"""`lit-mesh plan`: the best meshes for a model family (the zoo GPT by default) on a cluster, why, and a `lit-mesh fit`
config for the best.

lit-mesh plan --preset llama3-70b --devices 256 --out plan.yaml
lit-mesh plan --preset llama3-8b --devices 64 --simulate --plot plots/
lit-mesh plan --preset llama3-8b --devices 8 --out plan.yaml --rehearsal rehearsal.yaml  # then on CPU:
lit-mesh fit -c rehearsal.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lit_mesh.planner.vocabulary import AC_MODES, DIMS, FLOAT8_RECIPES, PRECISION_BYTES

if TYPE_CHECKING:  # the model, memory and time modules import torch: only once the arguments are good
    from lit_mesh.planner.hardware import Hardware
    from lit_mesh.planner.memory import Workload
    from lit_mesh.planner.search import Candidate, PlanResult
    from lit_mesh.planner.shapes import ModelShapes

PROG = "lit-mesh plan"
DEFAULT_DEVICES_PER_NODE = 8
DEFAULT_MODEL, DEFAULT_PRESET = "gpt", "llama3-8b"


class BadArgument(SystemExit):
    """A bad command line: the message on stderr, exit status 2 (argparse's own convention)."""

    def __init__(self, message: str) -> None:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _number(kind: type, low: float, low_open: bool, high: float | None = None) -> Any:
    """An argparse type: a finite `kind` above `low` (or at it, unless low_open) and up to `high`."""
    bound = f"> {low:g}" if low_open else f">= {low:g}"
    want = f"{'an integer' if kind is int else 'a number'} {bound}" + (f" and <= {high:g}" if high is not None else "")

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {want}") from None
        if (
            not math.isfinite(value)
            or value < low
            or (low_open and value == low)
            or (high is not None and value > high)
        ):
            raise argparse.ArgumentTypeError(f"{text} is not {want}")
        return value

    parse.__name__ = want  # argparse names the type in some messages
    return parse


COUNT = _number(int, 1, False)  # degrees, devices, batch, sequence length: whole and >= 1
POSITIVE = _number(float, 0, True)  # memory, peak, bandwidth: > 0
NON_NEGATIVE = _number(float, 0, False)  # reserve, latency: >= 0
FRACTION = _number(float, 0, True, 1.0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="model family: the zoo's gpt (zoo/gpt.py, the default) or moe (zoo/moe.py), or one registered in"
        " lit_mesh.planner.families",
    )
    p.add_argument(
        "--preset",
        default=None,
        help=f"a preset of the family (default {DEFAULT_PRESET}): gpt tiny, small, llama3-8b/70b/405b, ..."
        " (zoo/gpt.py); moe see zoo/moe.py",
    )
    p.add_argument(
        "--hf-config",
        default="",
        help="plan a transformers model instead of a preset: its directory (with config.json) or its config.json;"
        " Llama, Qwen2, Qwen3 and Mistral as the gpt family, Mixtral and qwen3_moe as moe"
        " (lit_mesh/planner/hf_config.py)",
    )
    p.add_argument("--config-overrides", default="", help="config fields over the preset, YAML/JSON: '{n_layers: 40}'")
    p.add_argument("--devices", type=COUNT, default=None, help="total devices (default: nodes x devices per node)")
    p.add_argument("--nodes", type=COUNT, default=None, help="nodes (default: devices / devices per node)")
    p.add_argument(
        "--devices-per-node",
        type=COUNT,
        default=None,
        help=f"devices of one node (default: --devices / --nodes when both are given, else {DEFAULT_DEVICES_PER_NODE})",
    )
    p.add_argument("--memory-gb", type=POSITIVE, default=80.0, help="memory per device, GB (1e9 bytes)")
    p.add_argument(
        "--reserve-gib", type=NON_NEGATIVE, default=4.0, help="per-device memory kept free (context, fragmentation)"
    )
    p.add_argument("--peak-tflops", type=POSITIVE, default=989.0, help="dense bf16 peak per device, TFLOP/s")
    p.add_argument(
        "--memory-tbps",
        type=POSITIVE,
        default=3.35,
        help="HBM bandwidth per device, TB/s (the memory-bound ops and the optimizer step)",
    )
    p.add_argument(
        "--efficiency",
        type=FRACTION,
        default=None,
        help="the fraction of peak the largest matmuls reach (default: the calibrated one, see"
        " lit_mesh/planner/calibration.yaml); smaller per-rank matmuls reach less",
    )
    p.add_argument("--intra-node-gbps", type=POSITIVE, default=450.0, help="per device, GB/s (NVLink)")
    p.add_argument("--inter-node-gbps", type=POSITIVE, default=50.0, help="per device, GB/s (network)")
    p.add_argument("--intra-node-latency-us", type=NON_NEGATIVE, default=5.0)
    p.add_argument("--inter-node-latency-us", type=NON_NEGATIVE, default=15.0)
    p.add_argument("--global-batch", type=COUNT, default=256, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=COUNT, default=8192, help="tokens per sequence (at most the preset's max_seq_len)")
    p.add_argument("--precision", nargs="+", default=["bf16-mixed"], choices=sorted(PRECISION_BYTES))
    p.add_argument("--ac", nargs="+", default=list(AC_MODES), choices=AC_MODES, help="activation checkpointing modes")
    for dim in (*DIMS, "ep"):
        p.add_argument(f"--{dim.replace('_', '-')}", type=COUNT, default=None, help=f"fix {dim} to this degree")
    p.add_argument(
        "--zero-stage",
        type=int,
        nargs="+",
        default=[3],
        choices=(1, 2, 3),
        help="ZeRO stages to search (MeshStrategy zero_stage): 3 FSDP; 2, 1 gather less and hold more",
    )
    p.add_argument(
        "--float8",
        choices=FLOAT8_RECIPES,
        default=None,
        help="the run's MeshStrategy float8 recipe: the blocks' linears at the float8 peak with their casts, and"
        " (tensorwise) FSDP gathering their weights in float8",
    )
    p.add_argument(
        "--routing-cv",
        type=NON_NEGATIVE,
        default=0.0,
        help="MoE, dropless: how unevenly the trained router spreads one sequence's tokens over the experts (the"
        " coefficient of variation of an expert's share); 0 (default) plans balanced routing (forced balance or a"
        " capacity factor); Qwen3-235B-A22B's router: 4.41 (lit_mesh/planner/calibration.yaml `routing`)",
    )
    p.add_argument("--top", type=COUNT, default=3, help="how many layouts to print")
    p.add_argument("--out", default="", help="write the best layout as a `lit-mesh fit` config (YAML) here")
    p.add_argument("--max-steps", type=COUNT, default=1000, help="trainer.max_steps of the written config")
    p.add_argument(
        "--rehearsal",
        default="",
        help="also write the best layout scaled down to a CPU smoke run here (every degree > 1 becomes 2,"
        " the tiny preset of the family, 32-true, a few steps): `lit-mesh fit -c` it before the big run",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="build the best layout on meta tensors over fake ranks and compare the true bytes",
    )
    p.add_argument("--plot", default="", help="directory for mesh.png and memory.png (and a TensorBoard log of both)")
    p.add_argument("--json", action="store_true", help="end with one JSON line (the ranked layouts)")
    return p.parse_args(argv)


def nodes_and_devices_per_node(devices: int | None, nodes: int | None, per_node: int | None) -> tuple[int, int]:
    """(nodes, devices per node) from whichever of the three flags are given; they must agree."""
    if devices is None and nodes is None:
        raise BadArgument("give --devices N (or --nodes N)")
    if devices is not None and nodes is not None:
        if per_node is None:
            if devices % nodes:
                raise BadArgument(
                    f"--devices {devices} do not spread evenly over --nodes {nodes}: give a multiple of"
                    f" {nodes} devices (or drop --nodes)"
                )
            return nodes, devices // nodes
        if devices != nodes * per_node:
            raise BadArgument(
                f"--devices {devices} disagrees with --nodes {nodes} x --devices-per-node {per_node} ="
                f" {nodes * per_node}: give two of the three, or make them agree"
            )
        return nodes, per_node
    per_node = per_node or DEFAULT_DEVICES_PER_NODE
    if nodes is not None:
        return nodes, per_node
    assert devices is not None
    if devices % per_node:
        one_node = f"--devices-per-node {devices} for one node" if devices < per_node else "--nodes N"
        raise BadArgument(
            f"--devices {devices} is not --nodes x --devices-per-node ({per_node}): give a multiple of"
            f" {per_node}, or set {one_node}"
        )
    return devices // per_node, per_node


def hardware_of(args: argparse.Namespace) -> Hardware:
    from lit_mesh.planner.hardware import GB, GIB, Hardware

    nodes, per_node = nodes_and_devices_per_node(args.devices, args.nodes, args.devices_per_node)
    if args.memory_gb * GB <= args.reserve_gib * GIB:
        raise BadArgument(
            f"--memory-gb {args.memory_gb:g} leaves nothing after the reserve of --reserve-gib"
            f" {args.reserve_gib:g}; give more memory or a smaller reserve"
        )
    extra = {} if args.efficiency is None else {"compute_efficiency": args.efficiency}
    return Hardware(
        nodes=nodes,
        devices_per_node=per_node,
        memory_bytes=args.memory_gb * GB,
        peak_flops=args.peak_tflops * 1e12,
        memory_bandwidth=args.memory_tbps * 1e12,
        intra_node_bandwidth=args.intra_node_gbps * GB,
        inter_node_bandwidth=args.inter_node_gbps * GB,
        intra_node_latency=args.intra_node_latency_us * 1e-6,
        inter_node_latency=args.inter_node_latency_us * 1e-6,
        reserve_bytes=args.reserve_gib * GIB,
        **extra,
    )


def model_config(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The preset with the overrides, checked against the sequence length asked for."""
    import dataclasses

    import yaml

    from lit_mesh.planner.families import family

    try:
        overrides = yaml.safe_load(args.config_overrides) if args.config_overrides else {}
    except yaml.YAMLError as e:
        raise BadArgument(f"--config-overrides {args.config_overrides!r} is not YAML: {e}".splitlines()[0]) from None
    shape = _hf_shape(args) if args.hf_config else {}
    if not args.hf_config:
        args.model, args.preset = args.model or DEFAULT_MODEL, args.preset or DEFAULT_PRESET
        args.label = args.preset
    try:
        model_family = family(args.model)
    except LookupError as e:
        raise BadArgument(f"--model {args.model}: {e}") from None
    fields = [f.name for f in dataclasses.fields(model_family.config_class)]
    if not isinstance(overrides or {}, dict) or set(overrides or {}) - set(fields):
        raise BadArgument(
            f"--config-overrides {args.config_overrides!r} must map {model_family.config_class.__name__}"
            f" fields ({', '.join(fields)}) to values, e.g. '{{n_layers: 40}}'"
        )
    overrides = {**shape, **(overrides or {})}  # the user's overrides over the transformers config's shape
    try:
        config = model_family.config(args.preset, **overrides)
    except (ValueError, TypeError) as e:
        raise BadArgument(f"--model {args.model}: {e}") from None
    if args.seq_len > config.max_seq_len:
        raise BadArgument(
            f"--seq-len {args.seq_len} exceeds the model's max_seq_len={config.max_seq_len} ({args.label}"
            f"{' with the overrides' if overrides else ''}): give --seq-len <= {config.max_seq_len}, or"
            f" raise it with --config-overrides '{{max_seq_len: {args.seq_len}}}'"
        )
    return config, overrides


def _hf_shape(args: argparse.Namespace) -> dict[str, Any]:
    """The family fields of --hf-config's model; sets args.model (its family), args.preset (the family's tiny
    preset: every shape field comes from the file) and args.label (what the report calls the model)."""
    from lit_mesh.planner.hf_config import read_hf_config

    if args.preset is not None:
        raise BadArgument(f"--preset {args.preset} and --hf-config {args.hf_config}: give one of the two")
    try:
        family_name, shape, model_type = read_hf_config(args.hf_config)
    except ValueError as e:
        raise BadArgument(str(e)) from None
    if args.model is not None and args.model != family_name:
        raise BadArgument(
            f"--model {args.model} and --hf-config {args.hf_config}: a {model_type} config is planned as the"
            f" {family_name} family; drop --model (or give --model {family_name})"
        )
    args.model, args.preset, args.label = family_name, "tiny", f"{model_type} ({args.hf_config})"
    return shape


def simulate_best(c: Candidate, config: Any, shapes: Any) -> list[dict[str, Any]]:
    """Estimate vs the real sharding on fake ranks, for the first rank of every stage that can be the worst."""
    from lit_mesh.planner.memory import first_rank_of_stage, stages_to_check, state_bytes
    from lit_mesh.planner.search import shapes_of
    from lit_mesh.planner.simulate import simulate_rank

    rows = []
    expert_tp = 1 if c.whole_experts else None
    shapes = shapes_of(c, shapes)  # the shapes the candidate was priced with
    for stage in stages_to_check(shapes, c.layout.pp, schedule=c.schedule):
        rank = first_rank_of_stage(c.layout, stage)
        estimate = state_bytes(shapes, c.layout, c.precision, rank, schedule=c.schedule)
        simulated = simulate_rank(config, c.layout, rank, c.precision, schedule=c.schedule, expert_tp=expert_tp)
        same = all(estimate[k] == simulated[k] for k in estimate)
        rows.append({"rank": rank, "stage": stage, "estimate": estimate, "simulated": simulated, "equal": same})
    return rows


STEP_LIMIT_BYTES = 2 * 2**30  # a real step of the rank runs here only below this estimate (tiny and small presets)


def check_step(c: Candidate, config: Any, shapes: Any) -> dict[str, Any]:
    """Counted vs estimated bytes per mesh dim and operation, and held activations, of one real step of rank 0
    (one micro-batch; under pp the schedule over its fewest micro-batches, activations not measured) over the fake
    process group; under pp also the unsharded gradients held through the schedule, and the same for one rank of
    every other stage that can be the worst (each in a process of its own: lit_mesh.planner.step_process); or why
    it was not run."""
    from dataclasses import replace

    from lit_mesh.parallel.pipeline.schedules import PipelineSettings
    from lit_mesh.planner.fake_step import fake_step
    from lit_mesh.planner.memory import activation_parts, first_rank_of_stage, ranks_to_check, stage_activations
    from lit_mesh.planner.pipeline_model import regathers
    from lit_mesh.planner.search import shapes_of
    from lit_mesh.planner.step_process import step_in_process

    if c.memory["total"] > STEP_LIMIT_BYTES:
        return {
            "skipped": f"the rank needs {c.memory['total'] / 2**30:.1f} GiB: a real step runs for tiny/small models"
        }
    n = (
        1
        if c.layout.pp == 1
        else PipelineSettings(c.schedule.name, None, c.schedule.stages_per_rank).n_microbatches(c.layout.pp)
    )
    work = replace(c.work, global_batch=c.work.micro_batch * c.layout.dp * n)
    mb, seq, zero, schedule = work.micro_batch, work.seq_len, c.zero_stage, c.schedule
    step: dict[str, Any] = dict(zero_stage=zero, schedule=schedule, microbatches=n, float8=c.float8)
    if c.whole_experts:  # MeshStrategy(expert_tp=1)
        step["expert_tp"] = 1
    if c.ep_nodes > 1:  # ep_dispatch="by_node": nodes of the size that splits an ep group over c.ep_nodes
        span = (1 if c.whole_experts else c.layout.tp) * c.layout.ep
        step.update(ep_dispatch="by_node", devices_per_node=span // c.ep_nodes)
    # the shapes the candidate was priced with, routing balanced: the fake step routes uniformly (as a balanced run)
    shapes = shapes_of(c, shapes).with_routing_cv(0.0)
    counts = fake_step(config, c.layout, mb, seq, 0, c.precision, c.ac, **step)
    # the CPU step runs torch's composite rms_norm (the planner's own estimate assumes CUDA's fused kernel)
    check: dict[str, Any] = {"microbatches": n, **_rank_check(c, shapes, work, 0, counts)}
    if counts.activations is not None and not (c.float8 and c.precision.endswith("-mixed")):
        held = activation_parts(shapes, c.layout, work, c.precision, c.ac, 0, fused_norm=False)["held"]
        check["activations"] = {"counted": counts.activations, "estimated": held}
    elif counts.activations is not None:  # torchao applies CUDA's autocast only: under autocast its CPU emulation
        # keeps fp32 inputs where a GPU keeps bf16 ones, so that count says nothing of the GPU's
        check["activations_not_compared"] = (
            "float8 under autocast on CPU keeps fp32 inputs where a GPU keeps bf16 ones; bf16-true compares them"
        )
    if c.layout.pp > 1:
        check["later_ranks"] = []
        activations = partial(
            stage_activations, shapes, c.layout, work, c.precision, c.ac, regathered=regathers(schedule, c.layout.pp)
        )
        for stage in (s for s in ranks_to_check(shapes, c.layout.pp, schedule, n, c.ac, activations) if s != 0):
            rank = first_rank_of_stage(c.layout, stage)
            later_counts = step_in_process(config, c.layout, mb, seq, rank, c.precision, c.ac, **step)
            check["later_ranks"].append(_rank_check(c, shapes, work, stage, later_counts))
    return check


def _rank_check(c: Candidate, shapes: Any, work: Any, stage: int, counts: Any) -> dict[str, Any]:
    """One stepped rank's counted bytes (and, under pp, unsharded gradients) beside the planner's estimates."""
    from lit_mesh.planner.memory import accumulated_grad_bytes, first_rank_of_stage
    from lit_mesh.planner.pipeline_model import gradients_exact
    from lit_mesh.planner.traffic import comm_bytes, merged_like

    estimate = comm_bytes(
        shapes,
        c.layout,
        work,
        c.precision,
        c.ac,
        zero_stage=c.zero_stage,
        stage=stage,
        schedule=c.schedule,
        float8=c.float8,
    )
    estimate = merged_like(estimate, counts.bytes)  # dims one group carries (ep = tp with whole experts)
    rows = [
        {
            "dim": dim,
            "op": op,
            "counted": counts.bytes.get(dim, {}).get(op, 0),
            "estimated": estimate.get(dim, {}).get(op, 0),
        }
        for dim in sorted({*counts.bytes, *estimate})
        for op in sorted({*counts.bytes.get(dim, {}), *estimate.get(dim, {})})
    ]
    check: dict[str, Any] = {
        "rank": first_rank_of_stage(c.layout, stage),
        "stage": stage,
        "bytes": rows,
        "seconds": counts.seconds,
    }
    if counts.accumulated_grads is not None:
        grads = accumulated_grad_bytes(shapes, c.layout, work, c.precision, stage, schedule=c.schedule)
        bound = not gradients_exact(c.schedule)  # the estimate is every local stage's at once
        check["accumulated_grads"] = {"counted": counts.accumulated_grads, "estimated": grads, "bound": bound}
    return check


def _within(counted: float, estimated: float, tolerance: float) -> bool:
    return abs(estimated - counted) <= tolerance * max(counted, 1)


def print_step_check(check: dict[str, Any]) -> bool:
    """Prints the comparison; True when every byte term is within 5%, the activations within 10% and, under pp,
    the unsharded gradients held through the schedule within 5%."""
    if "skipped" in check:
        print(f"\none real step: not run ({check['skipped']})")
        return True
    micro = f", {check['microbatches']} micro-batches through the pipeline" if check["microbatches"] > 1 else ""
    print(f"\none real step of rank 0 over the fake process group ({check['seconds']:.1f} s{micro}), bytes per step:")
    good = _print_rank(check)
    a = check.get("activations")
    if "activations_not_compared" in check:
        print(f"  activations: not compared ({check['activations_not_compared']})")
    elif a is None:  # a pipeline's forwards and backwards interleave: no one point where the forward is done
        print("  activations: not measured under pp")
    else:
        ok = _within(a["counted"], a["estimated"], 0.10)
        good &= ok
        print(
            f"  activations held into backward: counted {a['counted']:,} estimated {a['estimated']:,}{'' if ok else '  DIFFERS'}"
        )
    for later in check.get("later_ranks", ()):
        print(
            f"one real step of rank {later['rank']} (pp stage {later['stage']}, its own process, {later['seconds']:.1f} s):"
        )
        good &= _print_rank(later)
    return good


def _print_rank(check: dict[str, Any]) -> bool:
    good = True
    for r in check["bytes"]:
        ok = _within(r["counted"], r["estimated"], 0.05)
        good &= ok
        print(
            f"  {r['dim']:>12} {r['op']:<14} counted {r['counted']:>14,} estimated {r['estimated']:>14,.0f}{'' if ok else '  DIFFERS'}"
        )
    g = check.get("accumulated_grads")
    if g is not None:  # a bound (V schedules): the count may be lower
        ok = _within(g["counted"], g["estimated"], 0.05) or (g["bound"] and g["counted"] <= g["estimated"])
        good &= ok
        print(
            f"  unsharded gradients held through the schedule: counted {g['counted']:,} estimated {g['estimated']:,}"
            f"{' (at most)' if g['bound'] else ''}{'' if ok else '  DIFFERS'}"
        )
    return good


def summary(c: Candidate) -> dict[str, Any]:
    return {
        "layout": {d: getattr(c.layout, d) for d in (*DIMS, "ep")},
        "precision": c.precision,
        "ac": c.ac,
        "zero_stage": c.zero_stage,
        "float8": c.float8,
        "micro_batch": c.work.micro_batch,
        "microbatches": c.work.microbatches(c.layout),
        "pp_schedule": c.schedule.name,
        "pp_stages_per_rank": c.schedule.stages_per_rank,
        "memory": c.memory,
        "step_s": c.time.total,
        "tokens_per_s": c.tokens_per_s,
        "mfu": c.mfu,
        "reasons": c.reasons,
    }


def report(result: PlanResult, args: argparse.Namespace, hw: Hardware, params: int) -> None:
    from lit_mesh.planner.hardware import GIB

    size = f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.2f} M"
    print(
        f"lit-mesh plan: {args.label} ({size} parameters) on {hw.world_size} devices"
        f" ({hw.nodes} nodes x {hw.devices_per_node}), {args.memory_gb:g} GB each; global batch"
        f" {args.global_batch} x {args.seq_len} tokens"
    )
    print(f"considered {result.considered} (mesh, precision, AC) options; {len(result.ranked)} run and fit")
    for reason, count in result.rejected.most_common():
        print(f"  rejected {count}: {reason}")
    if not result.ranked:
        s = result.smallest
        if s is None:
            print("no mesh passes the divisibility rules: see the reasons above (e.g. --global-batch, --seq-len)")
            return
        state_total = s.memory["params"] + s.memory["grads"] + s.memory["optimizer"]
        need = hw.world_size * state_total / hw.usable_bytes
        print(f"nothing fits. The least memory: {s.name()} at {s.memory['total'] / GIB:.1f} GiB per device:")
        print("  " + s.reasons[0])
        print(
            f"  parameters + gradients + AdamW alone need about {need:.0f} devices of this size: use more devices,"
            " bf16-true (--precision bf16-true), or devices with more memory"
        )
        return
    for i, c in enumerate(result.ranked[: args.top], start=1):
        print(f"\n#{i} {c.name()}")
        for line in c.reasons:
            print(f"   - {line}")


def report_options(
    shown: Candidate, shapes: ModelShapes, work: Workload, hw: Hardware, args: argparse.Namespace
) -> dict[str, Any]:
    """Prints why each AC x schedule x micro-batch option of the best layout (nothing fits: the least-memory one)
    was rejected; returns every option of it for --json."""
    from lit_mesh.planner.rejections import layout_options, rejection_table

    layout = shown.layout
    options = layout_options(
        layout, shapes, work, hw, args.precision, args.ac, sorted(set(args.zero_stage), reverse=True)
    )
    degrees = {d: getattr(layout, d) for d in (*DIMS, "ep")}
    fitting = sum(o.rejected is None for o in options)
    name = " x ".join(f"{d}={v}" for d, v in degrees.items() if v > 1) or "one device"
    print(f"\noptions of {name}: {fitting} of {len(options)} (AC x schedule x micro-batch) run and fit", end="")
    if fitting == len(options):
        print()
    else:
        print("; rejected:")
        print("\n".join(rejection_table(options, layout.pp)))
    return {"layout": degrees, "options": [o.as_dict() for o in options]}


def main(argv: list[str]) -> int:
    """0: a plan (and --simulate agrees); 1: nothing fits, or --simulate disagrees; bad arguments exit 2."""
    args = parse_args(argv)
    start = time.perf_counter()
    config, overrides = model_config(args)
    hw = hardware_of(args)
    from lit_mesh.planner.memory import Workload
    from lit_mesh.planner.search import plan
    from lit_mesh.planner.shapes import gpt_shapes

    try:
        shapes = gpt_shapes(config)
    except (ValueError, RuntimeError) as e:  # e.g. moe_every != 1, or overrides the model cannot be built with
        raise BadArgument(f"{args.label} --config-overrides {args.config_overrides!r}: {e}") from None
    fixed = {d: getattr(args, d) for d in DIMS if getattr(args, d) is not None}
    if args.ep is not None and not shapes.is_moe:
        raise BadArgument(f"--ep {args.ep} needs an MoE model (--model moe); a dense model runs ep=1")
    if args.routing_cv and not shapes.is_moe:
        raise BadArgument(f"--routing-cv {args.routing_cv:g} describes an MoE router (--model moe); drop it here")
    shapes = shapes.with_routing_cv(args.routing_cv)
    if hw.world_size % math.prod(fixed.values()):
        given = ", ".join(f"--{d.replace('_', '-')} {v}" for d, v in fixed.items())
        raise BadArgument(
            f"{given}: the fixed degrees must be >= 1 and their product must divide the"
            f" {hw.world_size} devices; choose degrees among the divisors of {hw.world_size}"
        )
    work = Workload(args.global_batch, args.seq_len)
    result = plan(
        shapes,
        work,
        hw,
        args.precision,
        args.ac,
        {**fixed, **({"ep": args.ep} if args.ep else {})},
        zero_stages=sorted(set(args.zero_stage), reverse=True),
        float8=args.float8,
    )
    report(result, args, hw, shapes.numel())
    out: dict[str, Any] = {
        "preset": args.label,
        "devices": hw.world_size,
        "ranked": [summary(c) for c in result.ranked[: args.top]],
        "rejected": dict(result.rejected),
        "considered": result.considered,
    }
    if shown := result.ranked[0] if result.ranked else result.smallest:
        out["options"] = report_options(shown, shapes, work, hw, args)
    status = 0 if result.ranked else 1
    if result.ranked:
        best = result.ranked[0]
        if args.out:
            header = [
                f"lit-mesh plan {shlex.join(argv)}",
                f"best of {len(result.ranked)}: {best.name()}",
                *best.reasons,
            ]
            path = _write(args, best, overrides or {}, hw, header)
            print(f"\nwrote {path}: lit-mesh fit -c {path}")
            out["config"] = str(path)
        if args.rehearsal:
            path, gap = _write_rehearsal(args, best, hw, argv), "" if args.out else "\n"
            print(f"{gap}wrote {path}: the same mesh shape, scaled down for CPU: lit-mesh fit -c {path}")
            out["rehearsal"] = str(path)
        if args.simulate:
            rows = simulate_best(best, config, shapes)
            print(f"\nsimulated on {hw.world_size} fake ranks (meta tensors, lit_mesh's parallelize):")
            for r in rows:
                est, s = r["estimate"], r["simulated"]
                print(
                    f"  rank {r['rank']} (stage {r['stage']}): params {s['params']:,} B, grads {s['grads']:,} B,"
                    f" AdamW {s['optimizer']:,} B in {s['seconds']:.1f} s; estimate"
                    f" {'equal' if r['equal'] else 'DIFFERS: ' + str(est)}"
                )
            out["simulation"] = rows
            step = check_step(best, config, shapes)
            out["step_check"] = step
            status = 0 if all(r["equal"] for r in rows) and print_step_check(step) else 1
        if args.plot:
            from lit_mesh.planner.plot import plot_memory, plot_mesh

            folder = Path(args.plot)
            folder.mkdir(parents=True, exist_ok=True)
            pictures = [
                plot_mesh(best.layout, hw, folder / "mesh.png"),
                plot_memory(result.ranked[: args.top], hw, folder / "memory.png"),
            ]
            from lit_mesh.monitor.figures import write_tensorboard_images

            write_tensorboard_images(folder, {"plan/mesh": pictures[0], "plan/memory": pictures[1]})
            print(
                "\npictures: "
                + ", ".join(str(p) for p in pictures)
                + f" (also in TensorBoard: tensorboard --logdir {folder})"
            )
            out["plots"] = [str(p) for p in pictures]
    else:
        if args.out:
            print(f"\nnothing fits: {args.out} not written")
        if args.rehearsal:
            raise SystemExit(
                f"lit-mesh plan --rehearsal {args.rehearsal}: no layout fits, so there is no plan to"
                " rehearse (not written); see the reasons above: use more devices, bf16-true or more"
                " memory per device"
            )
    out["seconds"] = round(time.perf_counter() - start, 3)
    if args.json:
        print(json.dumps(out))
    return status


def _write(
    args: argparse.Namespace, best: Candidate, overrides: dict[str, Any], hw: Hardware, header: list[str]
) -> Path:
    from lit_mesh.planner.config_yaml import write_fit_config

    try:
        return write_fit_config(args.out, best, args.preset, overrides, hw, args.max_steps, header, args.model)
    except OSError as e:
        raise BadArgument(f"--out {args.out}: cannot write it ({e.strerror}); give a writable path") from None


def _write_rehearsal(args: argparse.Namespace, best: Candidate, hw: Hardware, argv: list[str]) -> Path:
    from lit_mesh.planner.config_yaml import rehearsal_config, write_yaml

    try:
        config = rehearsal_config(best, hw, args.model)
    except ValueError as e:
        raise SystemExit(f"lit-mesh plan --rehearsal {args.rehearsal}: {e}") from None
    degrees = {d: v for d, v in config["trainer"]["strategy"]["init_args"].items() if d in (*DIMS, "ep") and v > 1}
    header = [
        f"lit-mesh plan {shlex.join(argv)}",
        f"rehearsal of {best.name()} on {hw.world_size} devices:",
        f"  the same mesh scaled down ({', '.join(f'{d}={v}' for d, v in degrees.items()) or 'one device'}),"
        f" tiny {args.model}, 32-true, {config['trainer']['devices']} CPU processes",
    ]
    return write_yaml(args.rehearsal, config, header)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
