"""Context parallel: per-rank peak activation memory for cp 1, 2, 4, the longest sequence in a per-rank budget,
and the bytes each rank sends per step for every cp style against the formula.

One launch per cp degree (cp ranks, gloo on CPU, one thread per rank). Each rank runs the zoo GPT through
lit_mesh.parallel.apply.parallelize (the strategy's own order: CP, then FSDP over dp_shard x cp) and times
nothing: it runs forward + loss + backward of ONE sample whose sequence is split over the cp ranks, after one
warm-up step, inside two TorchDispatchModes:

  peak_bytes   the largest sum, at any op, of the storages created in the step that are still alive (every op
               output: activations, attention kernel outputs, P2P/collective buffers, FSDP's gathered
               parameters and the gradients). Storages that existed before the step (the parameter shards,
               the optimizer-free model) are not counted. Measured, not estimated; no allocator overhead.
  sent_bytes   lit_mesh.monitor's CollectiveBytes on the cp process group: P2P sends counted once, all-to-all
               (n-1)/n of the input, all-gather (n-1) x the input, reduce-scatter (n-1)/n of the input. FSDP's
               own (c10d) all-gathers and reduce-scatters share that group here and are reported apart.

Formulas per attention layer per step (forward + backward), N = cp, e = bytes per element, for this rank's
K and V as they reach scaled_dot_product_attention, S_kv = 2 B H_kv (T/N) D e, and S_q = B H (T/N) D e:
  ring       (N-1) S_kv (forward) + (N-1) S_kv (backward: K/V again) + N S_kv x 4/e (dK/dV accumulate in fp32)
  ulysses    2 (N-1)/N (2 S_q + S_kv')     q, k, v and the output, there and back; S_kv' with K/V heads repeated
                                          up to a multiple of N where N does not divide them
  allgather  (N-1) S_kv (all-gather) + (N-1) S_kv (reduce-scatter of dK/dV)
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lit_mesh.init import materialize  # noqa: E402
from lit_mesh.mesh import build_device_mesh, resolve_layout  # noqa: E402
from lit_mesh.monitor.comm import CollectiveBytes  # noqa: E402
from lit_mesh.options import ContextOptions, MeshDegrees, MeshOptions  # noqa: E402
from lit_mesh.parallel.apply import parallelize  # noqa: E402
from lit_mesh.parallel.context import CP_STYLES, shard_batch  # noqa: E402
from zoo.gpt import GPT, GPTConfig  # noqa: E402

GOAL = 1.25  # peak at cp=N <= GOAL x (peak at cp=1) / N


class AttentionBytes(CollectiveBytes):
    """CollectiveBytes that leaves out FSDP's c10d all-gathers and reduce-scatters: with dp_shard = 1 they run on
    the same process group as the cp attention (dp_shard x cp = cp), which uses P2P sends (ring) and functional
    collectives (Ulysses, all-gather). `fsdp` keeps what was left out, for the record."""

    FSDP_OPS = {
        "_allgather_base_",
        "allgather_into_tensor_coalesced_",
        "_reduce_scatter_base_",
        "reduce_scatter_tensor_coalesced_",
    }

    def __init__(self) -> None:
        super().__init__()
        self.fsdp = CollectiveBytes()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "c10d" and func._opname in self.FSDP_OPS:
            return self.fsdp.__torch_dispatch__(func, types, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


class Holder(nn.Module):
    """parallelize() applies plans to the modules under a root, as under a LightningModule."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.model = GPT(config)


def build(config: GPTConfig, cp: int, style: str) -> tuple[Holder, Any]:
    layout = resolve_layout(dist.get_world_size(), cp=cp)
    mesh = build_device_mesh(layout, "cpu")
    with torch.device("meta"):
        root = Holder(config)
    options = MeshOptions(mesh=MeshDegrees(cp=cp, sequence_parallel=False), context=ContextOptions(style))
    owners = parallelize(root, mesh, options, precision="32-true").owners
    materialize(root, owners, torch.device("cpu"))
    return root, mesh


def step(root: Holder, mesh: Any, style: str, seq_len: int, vocab: int, measure: bool) -> dict[str, float]:
    window = torch.randint(0, vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    tokens, targets = (window[:, :-1], window[:, 1:])
    if mesh["cp"].size() > 1:
        tokens, targets = shard_batch((tokens, targets), mesh["cp"], style)
    peak, comm = C.PeakStorages(), AttentionBytes()
    if measure:
        peak.__enter__()
        comm.__enter__()
    try:
        loss = F.cross_entropy(root.model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
    finally:
        if measure:
            comm.__exit__(None, None, None)
            peak.__exit__(None, None, None)
    root.zero_grad(set_to_none=True)
    cp_group = mesh["cp"].get_group().group_name if mesh["cp"].size() > 1 else None
    return {
        "peak_bytes": peak.peak,
        "sent_bytes_cp": comm.sent.get(cp_group, 0.0) if cp_group else 0.0,
        "sent_bytes_fsdp": sum(comm.fsdp.sent.values()),
    }


def measure(config: GPTConfig, cp: int, style: str, seq_len: int) -> dict[str, float]:
    root, mesh = build(config, cp, style)
    step(root, mesh, style, seq_len, config.vocab_size, measure=False)  # warm-up: one-time allocations
    found = step(root, mesh, style, seq_len, config.vocab_size, measure=True)
    return {key: max(values) for key, values in zip(found, zip(*[g.values() for g in C.gather(found)]))}


def longest_in_budget(
    config: GPTConfig, cp: int, style: str, budget: float, granularity: int, start: int
) -> dict[str, Any]:
    """Double the sequence while the worst rank's peak fits, then bisect to `granularity` tokens."""
    tried: dict[int, float] = {}

    def fits(length: int) -> bool:
        tried[length] = measure(config, cp, style, length)["peak_bytes"]
        return tried[length] <= budget

    ok, bad = 0, start
    while fits(bad):
        ok, bad = bad, bad * 2
    while bad - ok > granularity:
        middle = (ok + bad) // 2 // granularity * granularity
        if middle <= ok:
            break
        ok, bad = (middle, bad) if fits(middle) else (ok, middle)
    return {
        "longest_seq_len": ok,
        "first_too_long": bad,
        "peak_bytes_tried": {str(k): v for k, v in sorted(tried.items())},
    }


def formula_bytes(style: str, cp: int, config: GPTConfig, seq_len: int, element: int = 4) -> float:
    """Bytes one rank sends per step on the cp group (see the module docstring), all layers."""
    local = seq_len // cp
    heads = config.n_heads
    kv_heads = config.n_heads  # zoo GPT repeats K/V to the query heads before its SDPA call
    s_q = heads * local * config.attention_head_dim * element
    s_kv = 2 * kv_heads * local * config.attention_head_dim * element
    if style == "ring":
        per_layer = (cp - 1) * s_kv * 2 + cp * s_kv * 4 / element
    elif style == "ulysses":
        sent_heads = kv_heads if kv_heads % cp == 0 else math.lcm(kv_heads, cp)
        kv_sent = 2 * sent_heads * local * config.attention_head_dim * element
        per_layer = 2 * (cp - 1) / cp * (2 * s_q + kv_sent)
    else:
        per_layer = 2 * (cp - 1) * s_kv
    return per_layer * config.n_layers


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="zoo GPT preset")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="cp degrees (one launch each)")
    p.add_argument("--seq-len", type=int, default=2048, help="sequence length of the memory and bytes figures")
    p.add_argument(
        "--budget-mib", type=float, default=24.0, help="per-rank budget of the longest-sequence search; 0 skips"
    )
    p.add_argument("--budget-cp", type=int, nargs="+", default=[1, 4], help="cp degrees of the longest-sequence search")
    p.add_argument("--granularity", type=int, default=512, help="tokens: resolution of the longest-sequence search")
    p.add_argument("--timeout", type=float, default=500.0, help="seconds for each launch")
    p.add_argument("--worker-cp", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    cp = args.worker_cp
    config = GPTConfig.from_preset(args.preset, max_seq_len=1 << 20)
    styles = CP_STYLES if cp > 1 else ("ring",)  # cp=1: no context parallel, the style is never used
    result: dict[str, Any] = {"styles": {style: measure(config, cp, style, args.seq_len) for style in styles}}
    if args.budget_mib > 0 and cp in args.budget_cp:
        result["budget"] = longest_in_budget(config, cp, "ring", args.budget_mib * 2**20, args.granularity, start=1024)
    C.emit(result)
    dist.destroy_process_group()


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    """The launching process: one launch per cp degree, then the peaks and the traffic against the ideal."""
    if 1 not in args.cp:
        raise SystemExit("--cp must include 1: the cp=1 peak is what the ideal divides")
    config = GPTConfig.from_preset(args.preset)
    runs = {cp: C.launch(__file__, [*argv, "--worker-cp", str(cp)], cp, args.timeout) for cp in sorted(set(args.cp))}
    single = runs[1]["styles"]["ring"]["peak_bytes"]
    memory, traffic, goal_met = {}, {}, True
    for cp, run in runs.items():
        for style, figures in run["styles"].items():
            ratio = figures["peak_bytes"] / (single / cp)
            goal_met &= ratio <= GOAL or style == "allgather"  # it holds the whole K/V by design
            memory[f"cp{cp}" + (f"-{style}" if cp > 1 else "")] = {
                "peak_bytes": figures["peak_bytes"],
                "ideal_bytes": single / cp,
                "ratio": round(ratio, 3),
            }
            if cp > 1:
                expected = formula_bytes(style, cp, config, args.seq_len)
                traffic[f"cp{cp}-{style}"] = {
                    "sent_bytes": figures["sent_bytes_cp"],
                    "formula_bytes": expected,
                    "fsdp_sent_bytes_not_counted": figures["sent_bytes_fsdp"],
                    "ratio": round(figures["sent_bytes_cp"] / expected, 4),
                }
    result: dict[str, Any] = {
        "benchmark": "context_parallel",
        "peak_activation_memory": memory,
        "bytes_sent_per_step": traffic,
        "budget": {f"cp{cp}": runs[cp]["budget"] for cp in runs if "budget" in runs[cp]},
        "goal": f"peak at cp=N <= {GOAL} x peak(cp=1) / N for ring and ulysses (allgather holds all K/V: reported)",
        "goal_met": goal_met,
        "config": {
            "preset": args.preset,
            "batch_size": 1,
            "seq_len": args.seq_len,
            "budget_mib": args.budget_mib,
            "granularity": args.granularity,
            "precision": "32-true",
            "step": "forward + loss + backward, no optimizer",
            "mesh": "MeshStrategy order via parallelize(): cp=N, FSDP over dp_shard x cp = N",
            **C.environment(),
            "threads_per_rank": 1,
        },
    }
    C.print_result(result)


def main(argv: list[str]) -> None:
    C.run(argv, parse_args, worker, drive)


if __name__ == "__main__":
    main(sys.argv[1:])
