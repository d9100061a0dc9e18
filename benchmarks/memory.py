"""Per-rank memory of parameters, gradients and AdamW state under MeshStrategy FSDP, against the ideal.

For each N in --fsdp (default 1 2 4) one launch of N ranks trains a zoo GPT with MeshStrategy(dp=N) for one
step and counts, on every rank, the bytes it holds (the local shard of a DTensor, via .to_local()):
  params     after the step (resharded);
  grads      after the backward, before the optimizer step;
  optimizer  AdamW exp_avg + exp_avg_sq after the step (the scalar `step` is left out).
The ideal for N is the single-device total (the N=1 run) / N; ratio = max over ranks / ideal.

Bonus (--fake-preset, "none" to skip): a large preset on N fake ranks (torch's "fake" process group and meta
tensors, nothing allocated): rank 0's parameter shards after lit_mesh's own parallelize(), i.e. the code
MeshStrategy.setup runs. Rank 0 holds the largest shard when a dim does not divide evenly. Gradients and
AdamW state have the parameters' shapes and placements in fp32, so only parameters are counted there.

    python benchmarks/memory.py
    python benchmarks/memory.py --preset tiny --fsdp 1 2 --fake-preset none

Goal: ratio <= 1.05 for every component and every N.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)

GOAL = 1.05
COMPONENTS = ("params", "grads", "optimizer")


class MemoryProbe(Callback):
    """Bytes this rank holds, per component."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.bytes["grads"] = sum(C.local_bytes(p.grad) for p in pl_module.parameters() if p.grad is not None)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.bytes["params"] = sum(C.local_bytes(p) for p in pl_module.parameters())
        state = trainer.optimizers[0].state
        self.bytes["optimizer"] = sum(C.local_bytes(s[k]) for s in state.values() for k in ("exp_avg", "exp_avg_sq"))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="zoo GPT preset of the real runs")
    p.add_argument("--fsdp", type=int, nargs="+", default=[1, 2, 4], help="FSDP degrees N (one launch each)")
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--fake-preset", default="llama3-8b", help='preset for the fake-rank bonus; "none" skips it')
    p.add_argument("--fake-n", type=int, default=64, help="FSDP degree of the fake-rank bonus")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each launch")
    p.add_argument("--worker-n", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One real run with MeshStrategy(dp=N); rank 0 emits every rank's bytes."""
    from lit_mesh import MeshStrategy

    n = args.worker_n
    dist.init_process_group("gloo")  # Lightning finds it initialised and reuses it
    probe = MemoryProbe()
    module = C.BenchGPTModule(args.preset)
    trainer = L.Trainer(strategy=MeshStrategy(dp=n, process_group_backend="gloo"), **C.trainer_kwargs(n, 1, [probe]))
    trainer.fit(module, C.batch_loader(1, n, args.batch_size, args.seq_len, module.config.vocab_size))
    numel = sum(p.numel() for p in module.parameters())  # global (DTensor) sizes
    C.emit({"per_rank": C.gather(probe.bytes), "global_numel": numel, "layout": trainer.strategy.layout.describe()})
    dist.destroy_process_group()


def fake_rank_params(preset: str, n: int) -> dict[str, Any]:
    """Rank 0's parameter bytes for `preset` sharded over n fake ranks by lit_mesh.parallel.apply.parallelize."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit_mesh.mesh import build_device_mesh, resolve_layout
    from lit_mesh.parallel.apply import parallelize

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        layout = resolve_layout(n, dp=n)
        root = nn.Module()  # stands in for the LightningModule, which holds the network as `model`
        root.model = C.meta_gpt(preset)
        total = sum(p.numel() * p.element_size() for p in root.parameters())
        parallelize(root, build_device_mesh(layout, "cpu"), layout, sequence_parallel=True, precision="32-true")
        rank0 = sum(C.local_bytes(p) for p in root.parameters())
    finally:
        dist.destroy_process_group()
    ideal = total / n
    return {"preset": preset, "fsdp": n, "layout": layout.describe(), "single_device_param_bytes": total,
            "rank0_param_bytes": rank0, "ideal_param_bytes": ideal, "ratio": round(rank0 / ideal, 4),
            "note": "fake process group + meta tensors; grads and AdamW state share the parameters' sharding"}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if C.in_worker():
        worker(args)
        return
    if 1 not in args.fsdp:
        raise SystemExit("--fsdp must include 1: the N=1 run is the single-device total the ideal divides")
    runs = {n: C.launch(__file__, [*argv, "--worker-n", str(n)], n, args.timeout) for n in sorted(set(args.fsdp))}
    single = runs[1]["per_rank"][0]
    per_n: dict[str, Any] = {}
    goal_met = True
    for n, run in runs.items():
        entry: dict[str, Any] = {"layout": run["layout"]}
        for comp in COMPONENTS:
            values = [r[comp] for r in run["per_rank"]]
            ideal = single[comp] / n
            ratio = max(values) / ideal
            goal_met &= ratio <= GOAL
            entry[comp] = {"per_rank_bytes": values, "max_bytes": max(values), "ideal_bytes": ideal,
                           "ratio": round(ratio, 4)}
        per_n[str(n)] = entry
    result: dict[str, Any] = {
        "benchmark": "memory",
        "single_device_bytes": single,
        # cross-check: fp32 parameters are 4 bytes each, AdamW keeps two moments per parameter
        "expected_single_device_bytes": {"params": 4 * runs[1]["global_numel"], "grads": 4 * runs[1]["global_numel"],
                                         "optimizer": 8 * runs[1]["global_numel"]},
        "fsdp": per_n,
        "max_ratio": max(per_n[k][c]["ratio"] for k in per_n for c in COMPONENTS),
        "goal": f"max over ranks / (single-device / N) <= {GOAL} for params, grads and optimizer, every N",
        "goal_met": goal_met,
    }
    if args.fake_preset != "none":
        result["fake"] = fake_rank_params(args.fake_preset, args.fake_n)
    result["config"] = {
        "world_sizes": sorted(runs), "mesh": "MeshStrategy(dp=N): dp_shard=N", "preset": args.preset,
        "batch_size_per_rank": args.batch_size, "seq_len": args.seq_len, "steps": 1, "precision": "32-true",
        "optimizer": "AdamW(foreach)", "counted": "local shards (DTensor.to_local()), unpadded",
        **C.environment(), "threads_per_rank": 1,  # the launcher sets OMP_NUM_THREADS=1 in every rank
    }
    C.print_result(result)


if __name__ == "__main__":
    main(sys.argv[1:])
