"""Mixture of experts: all-to-all bytes against the formula, tokens/s for ep 1, 2, 4, and load balance over
training with and without balancing.

    python benchmarks/moe.py                         # both parts
    python benchmarks/moe.py --part throughput       # ep in 1, 2, 4: MeshStrategy(dp=ep, ep=ep), one launch each
    python benchmarks/moe.py --part balance          # one process, real text: imbalance per step, 3 arms

throughput: zoo MoEModule, fp32, AdamW, B sequences of T tokens per rank (weak scaling: the global batch grows
with ep). tokens/s = global tokens per step / median over measured steps of the slowest rank's step time
(on_train_batch_start -> on_train_batch_end). In one measured step a TorchDispatchMode records every token
all-to-all (forward dispatch and combine, and their backward) and the bytes each rank sends to OTHER ranks
(its own split excluded). Formula, from this rank's routing (router outputs) and the other ranks' (gathered
after the step): per MoE layer, (S + R) x (2 dim + 1) x 4 bytes, where S = this rank's assignments to experts held
elsewhere and R = assignments of other ranks to this rank's experts (forward: S out, each with its router weight
as one more column, R back; backward: the reverse). The count exchange (n_experts int64 per layer and forward) is reported apart.

balance: TextDataModule (the standard library's sources), tiny MoE, aux loss off unless the arm says so;
imbalance = max / mean tokens per expert, mean over MoE layers, per step. Arms: none, aux-loss-free bias
(--bias-rate), Switch aux loss (--aux-coef).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["all", "throughput", "balance"], default="all")
    p.add_argument("--eps", default="1,2,4", help="expert-parallel degrees (= world sizes) for throughput")
    p.add_argument("--preset", default="tiny", help="zoo MoE preset")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank (throughput)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="measured steps (throughput)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--balance-steps", type=int, default=300)
    p.add_argument("--balance-batch", type=int, default=8, help="global batch of the balance runs")
    p.add_argument("--balance-seq-len", type=int, default=64)
    p.add_argument("--bias-rate", type=float, default=0.001, help="aux-loss-free bias step")
    p.add_argument("--aux-coef", type=float, default=0.01, help="Switch aux loss coefficient (third arm)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--worker-ep", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- throughput and all-to-all bytes -------------------------------------------------------------------


class AllToAllBytes(TorchDispatchMode):
    """Bytes this rank sends to other ranks in variable-split all-to-alls (tokens) and in c10d ones (counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_bytes = 0
        self.token_calls = 0
        self.count_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func._opname
        if name == "all_to_all_single" and func.namespace == "_c10d_functional":
            tensor, input_splits, group = args[0], args[2], args[3]
            own = dist.get_rank(dist.distributed_c10d._resolve_process_group(group))
            rows = sum(input_splits) - input_splits[own]
            self.token_bytes += rows * tensor[0].numel() * tensor.element_size() if len(tensor) else 0
            self.token_calls += 1
        elif name == "combine_expert_outputs" and func.namespace == "lit_mesh":  # the combine's forward all-to-all
            rows, input_splits, group_name = args[0], args[4], args[5]
            own = dist.get_rank(dist.distributed_c10d._resolve_process_group(group_name))
            self.token_bytes += (sum(input_splits) - input_splits[own]) * rows[0].numel() * rows.element_size()
            self.token_calls += 1
        elif name == "alltoall_base_" and func.namespace == "c10d":
            tensor, group = args[1], args[2]
            n = dist.get_world_size(group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group))
            self.count_bytes += tensor.numel() * tensor.element_size() * (n - 1) // n
        return func(*args, **(kwargs or {}))


class MeasureStep(L.Callback):
    """Step times on every step; the all-to-all bytes and this rank's routing in step `measure_step`."""

    def __init__(self, measure_step: int) -> None:
        self.timer = C.StepTimer()
        self.measure_step = measure_step
        self.counter = AllToAllBytes()
        self.routing: list[torch.Tensor] = []  # per MoE layer: this rank's assignments per expert
        self._hooks: list[Any] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.measure_step:
            for moe in pl_module.model.moe_layers():
                self._hooks.append(moe.router.register_forward_hook(self._record))
            self.counter.__enter__()
        self.timer.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.timer.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if batch_idx == self.measure_step:
            self.counter.__exit__(None, None, None)
            for hook in self._hooks:
                hook.remove()

    def _record(self, module: Any, args: Any, routing: Any) -> None:
        n_experts = module.gate.out_features
        self.routing.append(torch.bincount(routing.expert_ids.flatten(), minlength=n_experts).cpu())


def throughput_worker(args: argparse.Namespace) -> None:
    from lit_mesh import MeshStrategy
    from zoo import MoEModule

    ep = args.worker_ep
    torch.manual_seed(0)
    module = MoEModule(preset=args.preset)
    measure = MeasureStep(measure_step=args.warmup)
    strategy = MeshStrategy(dp=ep, ep=ep, process_group_backend="gloo")
    trainer = L.Trainer(strategy=strategy, **C.trainer_kwargs(ep, args.warmup + args.steps, [measure]))
    loader = C.batch_loader(args.warmup + args.steps, ep, args.batch_size, args.seq_len, module.config.vocab_size)
    trainer.fit(module, loader)

    rank, config = dist.get_rank() if dist.is_initialized() else 0, module.config
    local = config.n_experts // ep
    mine = slice(rank * local, (rank + 1) * local)
    routing = torch.stack(measure.routing)  # (MoE layers, experts): this rank's assignments
    every_rank = C.gather(routing)
    sent_away = int(routing.sum() - routing[:, mine].sum())  # S, all layers
    received = sum(int(r[:, mine].sum()) for i, r in enumerate(every_rank) if i != rank)  # R, all layers
    # dispatch: S rows forward, R gradients back, each with its router weight column; combine: R rows back, S
    # gradients (lit_mesh/parallel/expert_combine.py)
    formula = (sent_away + received) * (2 * config.dim + 1) * 4
    per_rank = C.gather(
        {
            "measured": measure.counter.token_bytes,
            "formula": formula,
            "calls": measure.counter.token_calls,
            "count_bytes": measure.counter.count_bytes,
            "S": sent_away,
            "R": received,
            "steps": measure.timer.step_times(args.warmup),
        }
    )
    step = statistics.median(max(times) for times in zip(*(r["steps"] for r in per_rank)))
    tokens = args.batch_size * args.seq_len * ep
    assignments = args.batch_size * args.seq_len * config.top_k * len(routing)
    uniform = 2 * assignments * (ep - 1) / ep * (2 * config.dim + 1) * 4  # S = R = (ep-1)/ep of them if balanced
    C.emit(
        {
            "ep": ep,
            "world_size": ep,
            "tokens_per_step": tokens,
            "median_step_s": step,
            "tokens_per_s": tokens / step,
            "a2a_bytes_per_rank": [r["measured"] for r in per_rank],
            "a2a_formula_bytes": [r["formula"] for r in per_rank],
            "a2a_uniform_routing_bytes": uniform,
            "a2a_token_calls": per_rank[0]["calls"],
            "count_exchange_bytes": per_rank[0]["count_bytes"],
            "S_R": [(r["S"], r["R"]) for r in per_rank],
        }
    )


# ---- balance over training -----------------------------------------------------------------------------


class Imbalance(L.Callback):
    def __init__(self) -> None:
        self.per_step: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.per_step.append(float(trainer.callback_metrics["moe/imbalance"]))
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def balance_run(args: argparse.Namespace, bias_rate: float, aux_coef: float) -> dict[str, Any]:
    from zoo import MoEModule, TextDataModule

    L.seed_everything(0, verbose=False)
    module = MoEModule(preset=args.preset, config_overrides={"aux_loss_coef": aux_coef, "bias_update_rate": bias_rate})
    data = TextDataModule(global_batch_size=args.balance_batch, seq_len=args.balance_seq_len)
    record = Imbalance()
    kwargs = C.trainer_kwargs(1, args.balance_steps, [record])
    # the module logs the balance on logging steps only: every step is one here (the curve is per step)
    L.Trainer(**{**kwargs, "strategy": "auto", "log_every_n_steps": 1}).fit(module, data)
    steps = record.per_step
    tail = max(1, len(steps) // 3)
    return {
        "bias_rate": bias_rate,
        "aux_coef": aux_coef,
        "steps": len(steps),
        "imbalance_first_20": statistics.mean(steps[:20]),
        "imbalance_last_third": statistics.mean(steps[-tail:]),
        "imbalance_max_last_third": max(steps[-tail:]),
        "lm_loss_last_20": statistics.mean(record.losses[-20:]),
        "imbalance_every_25_steps": [round(v, 3) for v in steps[::25]],
    }


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    """The launching process: the throughput launches per ep, then the balance runs."""
    result: dict[str, Any] = {"benchmark": "moe", "preset": args.preset}
    if args.part in ("all", "throughput"):
        runs = []
        for ep in (int(e) for e in args.eps.split(",")):
            runs.append(C.launch(__file__, [*argv, "--worker-ep", str(ep)], ep, args.timeout))
        result["throughput"] = runs
        result["a2a_goal_met"] = all(r["a2a_bytes_per_rank"] == r["a2a_formula_bytes"] for r in runs)
        result["throughput_config"] = {
            "batch_size_per_rank": args.batch_size,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "warmup": args.warmup,
            "mesh": "dp=ep, ep=ep (FSDP ep)",
        }
    if args.part in ("all", "balance"):
        arms = {"none": (0.0, 0.0), "aux_loss_free": (args.bias_rate, 0.0), "aux_loss": (0.0, args.aux_coef)}
        result["balance"] = {name: balance_run(args, *arm) for name, arm in arms.items()}
        result["balance_config"] = {
            "global_batch": args.balance_batch,
            "seq_len": args.balance_seq_len,
            "data": "TextDataModule (stdlib sources)",
        }
        b = result["balance"]
        result["balance_goal_met"] = b["aux_loss_free"]["imbalance_last_third"] < b["none"]["imbalance_last_third"]
    result["environment"] = C.environment()
    C.print_result(result)


def main(argv: list[str]) -> None:
    C.run(argv, parse_args, throughput_worker, drive)


if __name__ == "__main__":
    main(sys.argv[1:])
