"""Training throughput of MeshStrategy against Lightning's own ModelParallelStrategy.

Both train zoo.gpt.GPT with FSDP2 x TP/SP on the same batches, steps and precision, in the same Lightning
loop. Under ModelParallelStrategy(data_parallel_size, tensor_parallel_size) the LightningModule applies the
parallelism itself in configure_model, on self.device_mesh["data_parallel"] / ["tensor_parallel"], with the
same torch ParallelStyles (torchtitan's Llama plan) and fully_shard per block then root; under MeshStrategy
the model's parallel_plan() is applied by the strategy. Runs alternate (mesh, modelparallel, modelparallel,
mesh, ...) in the same processes.

    python benchmarks/vs_modelparallel.py                   # 4 ranks: dp=2 x tp=2, preset small
    python benchmarks/vs_modelparallel.py --dp 1 --tp 2     # 2 ranks

Throughput of one run: global tokens of the measured steps / wall time from the end of the last warm-up step
to the end of the last step on the slowest rank (data loading and hooks included).
Result: ratio = median tokens/s (MeshStrategy) / median tokens/s (ModelParallelStrategy); goal ratio >= 1.0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import lightning as L
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_mesh import MeshStrategy

GOAL = 1.0


class HandParallelGPTModule(C.BenchGPTModule):
    """GPTModule for ModelParallelStrategy: configure_model parallelises the network by hand."""

    def __init__(self, preset: str, sequence_parallel: bool, log_loss: bool = False) -> None:
        super().__init__(preset, log_loss)
        self.sequence_parallel = sequence_parallel

    def configure_model(self) -> None:
        if self.model is not None:
            return
        gpt = C.meta_gpt(self.hparams.preset)
        C.hand_parallelize(
            gpt, self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"], self.sequence_parallel
        )
        C.materialize_gpt(gpt)  # the same weights as MeshStrategy gives (lit_mesh.init, seed 0)
        self.model = gpt


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_timing_arguments(p, repeats=4, timeout=170.0)
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--log-loss", action="store_true", help="keep GPTModule's per-step self.log(sync_dist=True)")
    return p.parse_args(argv)


def fit(args: argparse.Namespace, which: str) -> tuple[float, list[float]]:
    """One Trainer.fit; (this rank's measured window in seconds, its measured step times)."""
    world_size = args.dp * args.tp
    if which == "mesh":
        module: C.BenchGPTModule = C.BenchGPTModule(args.preset, args.log_loss)
        strategy: Any = MeshStrategy(
            dp=args.dp, tp=args.tp, sequence_parallel=args.sequence_parallel, process_group_backend="gloo"
        )
    else:
        module = HandParallelGPTModule(args.preset, args.sequence_parallel, args.log_loss)
        strategy = ModelParallelStrategy(
            data_parallel_size=args.dp, tensor_parallel_size=args.tp, process_group_backend="gloo"
        )
    timer = C.StepTimer()
    trainer = L.Trainer(strategy=strategy, **C.trainer_kwargs(world_size, args.warmup + args.steps, [timer]))
    trainer.fit(
        module,
        C.batch_loader(args.warmup + args.steps, args.dp, args.batch_size, args.seq_len, module.config.vocab_size),
    )
    return timer.window(args.warmup), timer.step_times(args.warmup)


def worker(args: argparse.Namespace) -> None:
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the first step also builds FSDP's buffers)")
    dist.init_process_group("gloo")  # Lightning finds it initialised and reuses it
    tokens = args.steps * args.dp * args.batch_size * args.seq_len  # global tokens of one run's measured steps
    throughput: dict[str, list[float]] = {"mesh": [], "modelparallel": []}
    steps: dict[str, list[float]] = {"mesh": [], "modelparallel": []}
    for r in range(args.repeats):
        order = ("mesh", "modelparallel") if r % 2 == 0 else ("modelparallel", "mesh")  # ABBA against drift
        for which in order:
            window, step_times = fit(args, which)
            throughput[which].append(tokens / max(C.gather(window)))  # the slowest rank sets the pace
            steps[which] += step_times
    mesh_tps = statistics.median(throughput["mesh"])
    mp_tps = statistics.median(throughput["modelparallel"])
    ratio = mesh_tps / mp_tps
    result: dict[str, Any] = {
        "benchmark": "vs_modelparallel",
        "mesh_tokens_per_s": round(mesh_tps, 1),
        "modelparallel_tokens_per_s": round(mp_tps, 1),
        "ratio": round(ratio, 4),
        "tokens_per_s_per_repeat": {k: [round(v, 1) for v in vs] for k, vs in throughput.items()},
        "median_step_s": {k: round(C.slowest_rank_median(C.gather(v)), 6) for k, v in steps.items()},
        "goal": f"ratio >= {GOAL}",
        "goal_met": ratio >= GOAL,
        "config": C.timing_config(
            args,
            modelparallel={"data_parallel_size": args.dp, "tensor_parallel_size": args.tp},
            sequence_parallel=args.sequence_parallel,
            tokens_per_run=tokens,
            optimizer="AdamW(foreach)",
            log_loss=args.log_loss,
            statistic="median over repeats of global tokens / slowest rank's wall time of the measured steps",
        ),
    }
    C.emit(result)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    C.run(argv, parse_args, worker, C.launch_once(__file__, lambda args: args.dp * args.tp))


if __name__ == "__main__":
    main(sys.argv[1:])
