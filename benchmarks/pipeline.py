"""Pipeline bubble and activation memory per schedule, measured, next to the textbook formulas.

For each schedule, `MeshStrategy(pp=P, pp_schedule=..., pp_microbatches=M)` trains the zoo GPT; on the measured
steps every rank times each forward / backward / weight-gradient block it computes (lit_mesh.PipelineTimeline's
recorder) and counts the bytes autograd holds for backward. Per rank: bubble = 1 - busy / step time; the figure
is the median over ranks of the median over steps. Peak activation memory = the most bytes held at once
(saved_tensors_hooks; a storage saved twice counts twice), max over ranks.

Formulas (p stages-ranks, m micro-batches, v stages per rank; ideal F = B = W block times):
  gpipe, 1f1b (p-1)/(m+p-1)   interleaved_1f1b (p-1)/(v m + p-1)   zero_bubble (interleaved, ZB-H1 shape)
  (p-1)/(3 v m + p-1)   -- 1F1B has GPipe's bubble but holds at most p micro-batches' activations, not m.
  2bw (PipeDream-2BW: 1F1B without a flush, updates one step late) 0 after step 0's warm-up.
Throughput: tokens per second of the pipelined part of a step (batch x seq_len / the recorded step time, median).

2bw against 1f1b on the same model and micro-batches: --schedules 1f1b 2bw

Usage: python benchmarks/pipeline.py [--pp 2] [--microbatches 4] [--schedules gpipe 1f1b ...] [--repeats 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from lit_mesh import MeshStrategy  # noqa: E402
from lit_mesh.monitor.pipeline_timeline import TimelineRecorder, bubble_formula  # noqa: E402


class RecordSteps(L.Callback):
    """Attach a TimelineRecorder to every step from `warmup` on; keep each step's summary."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps: list[dict[str, Any]] = []
        self._recorder: TimelineRecorder | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        runner = trainer.strategy._pipeline
        if trainer.global_step >= self.warmup:
            self._recorder = runner.recorder = TimelineRecorder(runner, pl_module.device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._recorder is not None:
            summary = self._recorder.summary()
            summary.pop("blocks")
            self.steps.append(summary)
            trainer.strategy._pipeline.recorder = self._recorder = None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"])
    p.add_argument("--stages-per-rank", type=int, default=2, help="v of the interleaved schedules")
    p.add_argument("--preset", default="small", help="zoo GPT preset (small: 4 blocks)")
    p.add_argument("--batch-size", type=int, default=8, help="per step (one pipeline replica)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="run the schedules in turn this many times (one median)")
    p.add_argument("--timeout", type=float, default=500.0)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    measured: dict[str, list[list[dict[str, Any]]]] = {}  # schedule -> per rank, the measured steps of every repeat
    settings: dict[str, int] = {}
    # the schedules in turn, --repeats times: drifting load on a shared machine falls on each of them alike
    for schedule in args.schedules * args.repeats:
        many = schedule not in ("gpipe", "1f1b", "2bw")
        strategy = MeshStrategy(
            pp=args.pp,
            pp_schedule=schedule,
            pp_microbatches=args.microbatches,
            pp_stages_per_rank=args.stages_per_rank if many else None,
        )
        recorder = RecordSteps(args.warmup)
        module = C.BenchGPTModule(args.preset)
        data = C.batch_loader(args.steps, 1, args.batch_size, args.seq_len, module.config.vocab_size)
        trainer = L.Trainer(strategy=strategy, **C.trainer_kwargs(args.pp, args.steps, [recorder]))
        trainer.fit(module, data)
        per_rank = C.gather(recorder.steps)
        settings[schedule] = strategy._pipeline.settings.local_stages()
        measured[schedule] = [a + b for a, b in zip(measured.get(schedule, [[] for _ in per_rank]), per_rank)]
    C.emit(
        {"schedules": {name: summarise(name, per_rank, settings[name], args) for name, per_rank in measured.items()}}
    )


def summarise(schedule: str, per_rank: list[list[dict[str, Any]]], v: int, args: argparse.Namespace) -> dict[str, Any]:
    bubbles = [statistics.median(s["bubble_fraction"] for s in steps) for steps in per_rank]
    step_time = statistics.median(s["step_time_s"] for steps in per_rank for s in steps)
    return {
        "bubble_measured": round(statistics.median(bubbles), 4),
        "bubble_per_rank": [round(b, 4) for b in bubbles],
        "bubble_formula": round(bubble_formula(schedule, args.pp, args.microbatches, v), 4),
        "stages_per_rank": v,
        "step_time_s": round(step_time, 4),
        "tokens_per_s": round(args.batch_size * args.seq_len / step_time, 1),
        "peak_activation_bytes_max_rank": max(
            max(s["peak_saved_activation_bytes"] for s in steps) for steps in per_rank
        ),
        "peak_activation_bytes_per_rank": [max(s["peak_saved_activation_bytes"] for s in steps) for steps in per_rank],
    }


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    """The launching process: one launch of pp ranks, its result with the config."""
    result = C.launch(__file__, argv, args.pp, args.timeout)
    result = {
        "benchmark": "pipeline",
        **result,
        "config": {
            "pp": args.pp,
            "microbatches": args.microbatches,
            "preset": args.preset,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "steps": args.steps,
            "measured_steps": args.steps - args.warmup,
            "repeats": args.repeats,
            "statistic": "bubble: median over ranks of the median over measured steps; memory: max over steps",
            **C.environment(),
            "threads_per_rank": 1,
        },
    }
    C.print_result(result)


def main(argv: list[str]) -> None:
    C.run(argv, parse_args, worker, drive)


if __name__ == "__main__":
    main(sys.argv[1:])
