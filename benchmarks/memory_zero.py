"""ZeRO stages: per-rank parameter, gradient and AdamW bytes of MeshStrategy(dp=N, zero_stage=1|2|3) against
the ZeRO paper's formulas (Rajbhandari et al. 2020, figure 1), adapted to fp32 AdamW (no separate master copy:
parameters 4 bytes, gradients 4, exp_avg + exp_avg_sq 8 per parameter; Psi parameters, N data-parallel ranks):

    stage 1: 4 Psi   + 4 Psi   + 8 Psi / N      (optimizer state sharded)
    stage 2: 4 Psi   + 4 Psi/N + 8 Psi / N      (and gradients)
    stage 3: 4 Psi/N + 4 Psi/N + 8 Psi / N      (and parameters: FSDP)

Run by `python benchmarks/memory.py --zero` (one launch of N ranks per N in --fsdp, one fit per stage in it, each
one step of ACCUMULATE micro-batches on the zoo GPT). Counted on every rank (local shards, unpadded):
  params           between the micro-batches of a step: the parameters forward and backward use (FSDP2's gathered
                   copies where a unit is gathered, else the shards);
  master_shard     FSDP2's sharded fp32 parameters kept beside a gathered copy (stages 1 and 2 only). The fp32
                   adaptation above has no master copy; the paper's mixed-precision accounting counts this shard in
                   the optimizer state (K = 12). It is reported, compared with 4 Psi / N, and in the total;
  grads            between the micro-batches: every gradient byte held (.grad and FSDP2's unsharded accumulation);
  grads_before_step  after the last backward (every stage: reduced and sharded, 4 Psi / N);
  optimizer        AdamW exp_avg + exp_avg_sq after the step.
Goal: max over ranks / formula <= 1.05 for params, grads and optimizer on every stage and N.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from memory import ACCUMULATE, GOAL, gradient_bytes
from torch.distributed.fsdp import FSDPModule

STAGES = (1, 2, 3)
# bytes per parameter of each component under stage s, as (numerator, sharded over N?)
FORMULA = {
    1: {"params": (4, False), "grads": (4, False), "optimizer": (8, True)},
    2: {"params": (4, False), "grads": (4, True), "optimizer": (8, True)},
    3: {"params": (4, True), "grads": (4, True), "optimizer": (8, True)},
}
CHECKED = ("params", "grads", "optimizer")


def formula_bytes(stage: int, numel: int, n: int) -> dict[str, float]:
    out = {c: b * numel / (n if sharded else 1) for c, (b, sharded) in FORMULA[stage].items()}
    out["master_shard"] = 4 * numel / n if stage < 3 else 0.0
    out["grads_before_step"] = 4 * numel / n
    return out


def parameter_bytes(module: torch.nn.Module) -> dict[str, int]:
    """(params, master_shard): what forward and backward use, and the shards kept beside gathered copies.
    Read from FSDP2's parameter groups (private: torch exposes no accessor for the gathered state)."""
    working = master = 0
    managed: set[int] = set()
    for unit in module.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        if group is None:
            continue
        for param in group.fsdp_params:  # while gathered, the module's parameters are the gathered copies
            managed.update({id(param.sharded_param), id(getattr(param, "_unsharded_param", None))})
            shard = C.local_bytes(param.sharded_param)
            if group.is_unsharded:
                working += C.local_bytes(param.unsharded_param)
                master += shard
            else:
                working += shard
    working += sum(C.local_bytes(p) for p in module.parameters() if id(p) not in managed)  # no FSDP (N = 1)
    return {"params": working, "master_shard": master}


class StageProbe(Callback):
    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "grads" not in self.bytes:  # the first of ACCUMULATE micro-batches: the step is still going on
            self.bytes.update(parameter_bytes(pl_module), grads=gradient_bytes(pl_module))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.bytes["grads_before_step"] = sum(
            C.local_bytes(p.grad) for p in pl_module.parameters() if p.grad is not None
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        state = trainer.optimizers[0].state
        self.bytes["optimizer"] = sum(C.local_bytes(s[k]) for s in state.values() for k in ("exp_avg", "exp_avg_sq"))


def worker(args: argparse.Namespace) -> None:
    """Rank side: one fit per stage (N = 1: one fit, nothing to shard); rank 0 emits every rank's bytes."""
    from lit_mesh import MeshStrategy

    n = args.worker_n
    dist.init_process_group("gloo")
    runs: dict[str, Any] = {}
    for stage in STAGES if n > 1 else (3,):
        print(f"zero stages: N={n} stage {stage}", file=sys.stderr, flush=True)
        probe, module = StageProbe(), C.BenchGPTModule(args.preset)
        strategy = MeshStrategy(dp=n, zero_stage=stage, process_group_backend="gloo") if n > 1 else MeshStrategy()
        trainer = L.Trainer(strategy=strategy, accumulate_grad_batches=ACCUMULATE, **C.trainer_kwargs(n, 1, [probe]))
        trainer.fit(module, C.batch_loader(ACCUMULATE, n, args.batch_size, args.seq_len, module.config.vocab_size))
        runs[str(stage)] = {"per_rank": C.gather(probe.bytes), "layout": trainer.strategy.layout.describe()}
        numel = sum(p.numel() for p in module.parameters())  # global (DTensor) sizes
    C.emit({"runs": runs, "global_numel": numel})
    dist.destroy_process_group()


def drive(args: argparse.Namespace, argv: list[str], script: str) -> None:
    """Launching side (`script`: benchmarks/memory.py): one launch per N, then every component against its formula."""
    launched = {n: C.launch(script, [*argv, "--worker-n", str(n)], n, args.timeout) for n in sorted(set(args.fsdp))}
    numel = launched[min(launched)]["global_numel"]
    table: dict[str, Any] = {}
    goal_met = True
    for n, launch in launched.items():
        for stage_key, run in launch["runs"].items():
            stage = int(stage_key) if n > 1 else 3  # one rank: every stage is the same, all whole
            formula = formula_bytes(stage, numel, n)
            entry: dict[str, Any] = {"layout": run["layout"]}
            for comp, expected in formula.items():
                values = [r[comp] for r in run["per_rank"]]
                ratio = max(values) / expected if expected else None
                entry[comp] = {
                    "per_rank_bytes": values,
                    "max_bytes": max(values),
                    "formula_bytes": expected,
                    "ratio": None if ratio is None else round(ratio, 4),
                }
                if comp in CHECKED:
                    goal_met &= ratio <= GOAL
            measured_total = max(sum(r[c] for c in (*CHECKED, "master_shard")) for r in run["per_rank"])
            entry["total"] = {
                "max_bytes": measured_total,
                "formula_bytes": sum(formula[c] for c in CHECKED),
                "ratio": round(measured_total / sum(formula[c] for c in CHECKED), 4),
            }
            table[f"N={n} stage {stage}" if n > 1 else "N=1"] = entry
    C.print_result(
        {
            "benchmark": "memory_zero",
            "global_numel": numel,
            "formulas": {
                str(s): {c: f"{b} Psi" + (" / N" if sh else "") for c, (b, sh) in FORMULA[s].items()} for s in STAGES
            },
            "runs": table,
            "max_ratio": max(e[c]["ratio"] for e in table.values() for c in CHECKED),
            "goal": f"max over ranks / formula <= {GOAL} for params, grads and optimizer, every stage and N",
            "goal_met": goal_met,
            "config": {
                "preset": args.preset,
                "world_sizes": sorted(launched),
                "batch_size_per_rank": args.batch_size,
                "seq_len": args.seq_len,
                "accumulate_grad_batches": ACCUMULATE,
                "steps": 1,
                "precision": "32-true",
                "optimizer": "AdamW(foreach)",
                "counted": "local shards (DTensor.to_local()), unpadded",
                **C.environment(),
                "threads_per_rank": 1,
            },
        }
    )
