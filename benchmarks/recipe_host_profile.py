"""Host time per step of the GPU recipe (configs/gpu.yaml), attributed on CPU: the data, the LR scheduler, each
callback (the progress bar is one), the loggers, against the model's forward, backward and optimizer step.

The recipe runs in this process, as `lit-mesh fit -c configs/gpu.yaml` with its callbacks, logger, data module,
optimizer groups and warm-up, clipping and logging interval, but a model small enough that the host's own work shows
(the tiny preset, fp32 on CPU, no compile), on the one-GPU run's 8,192 tokens per step (as 32 x 256 by default).
Lightning's SimpleProfiler times every hook and loop action; a step is the time between two `on_train_batch_start`s.
Reported in ms per step (mean after --warmup steps), apart for the steps between logging steps (what MeshMonitor
times, so what the recipe's MFU reads) and the logging steps:

- `outside_optimizer_step_ms`: the step minus Lightning's `run_training_batch` (forward, backward, clipping,
  optimizer): fetching the batch, the callbacks' batch hooks, the scheduler, logging, the progress bar;
- `categories_ms` and `actions_ms`: every profiled action run each step, alone and summed by category (data,
  scheduler, callback:NAME, model, strategy, loop). Actions nest (run_training_batch holds the optimizer step,
  which holds the forward and backward): a category's sum is not a share of the step.

    python benchmarks/recipe_host_profile.py
    python benchmarks/recipe_host_profile.py --steps 20 --warmup 2 -- --trainer.callbacks=null

Arguments after `--` are appended to the recipe's (LightningCLI overrides). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
from lightning.pytorch import Callback, LightningModule, Trainer

from lit_mesh.cli import run  # noqa: E402 (importable once _common has put the repo on sys.path)

RECIPE = C.REPO / "configs" / "gpu.yaml"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="profiled steps (the recipe logs every 10th)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out first")
    p.add_argument("--preset", default="tiny", help="zoo GPT preset (the recipe's is llama3.2-1b)")
    # the one-GPU run's 8,192 tokens per step (4 x 2048), in shorter rows: attention's T^2 is no host cost
    p.add_argument("--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus size (the recipe's: 100 MB)")
    return p.parse_args(own), extra


class StepClock(Callback):
    """The time at each on_train_batch_start (a step is the time between two of them) and whether it logs."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.logs: list[bool] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.logs.append(trainer._logger_connector.should_update_logs)


def category(action: str) -> str:
    if "dataloader_next" in action or action.endswith("batch_to_device") or "transfer_batch" in action:
        return "data"
    if "lr_scheduler_step" in action:
        return "scheduler"
    if action.startswith("[Callback]"):
        return "callback:" + action.removeprefix("[Callback]").rsplit(".", 1)[0].split("{")[0]
    if action.startswith("[LightningModule]"):
        return "model"
    if action.startswith("[Strategy]"):
        return "strategy"
    return "loop"


def per_step_actions(durations: dict[str, list[float]], n_steps: int) -> dict[str, list[float]]:
    """Seconds per step of each action Lightning runs a fixed number of times every step (the others, setup, epoch
    ends and the final save, are left out)."""
    out = {}
    for action, times in durations.items():
        calls, rest = divmod(len(times), n_steps)
        if calls and rest <= calls:  # the extra calls: the step after the last one timed
            out[action] = [sum(times[i * calls : (i + 1) * calls]) for i in range(n_steps)]
    return out


def summary(steps: list[float], actions: dict[str, list[float]], picked: list[int]) -> dict[str, Any] | None:
    """Mean ms per step over the steps `picked`: the step, Lightning's run_training_batch, the rest, and each
    category and action (None: no step picked, e.g. a run too short to log)."""
    if not picked:
        return None

    def mean_ms(values: list[float]) -> float:
        return 1e3 * statistics.mean(values[i] for i in picked)

    step = mean_ms(steps)
    batch = mean_ms(actions["run_training_batch"])
    means = {action: mean_ms(values) for action, values in actions.items()}
    categories: dict[str, float] = defaultdict(float)
    for action, ms in means.items():
        categories[category(action)] += ms
    top = sorted(means.items(), key=lambda kv: -kv[1])
    return {
        "steps": len(picked),
        "step_ms": step,
        "run_training_batch_ms": batch,
        "outside_optimizer_step_ms": step - batch,
        "categories_ms": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "actions_ms": {action: ms for action, ms in top if ms >= 0.01},  # under 10 us: left out
    }


def main(argv: list[str]) -> None:
    args, extra = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = [
            "fit",
            "-c",
            str(RECIPE),
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            "--trainer.precision=32-true",
            "--trainer.strategy.init_args.compile_blocks=false",
            f"--trainer.max_steps={args.warmup + args.steps + 1}",  # +1: the last step's end is the next's start
            f"--trainer.default_root_dir={tmp}",
            f"--trainer.logger.init_args.save_dir={tmp}",
            "--trainer.profiler=simple",
            f"--model.init_args.preset={args.preset}",
            f"--model.init_args.config_overrides={{max_seq_len: {args.seq_len}}}",
            f"--data.init_args.global_batch_size={args.batch_size}",
            f"--data.init_args.seq_len={args.seq_len}",
            f"--data.init_args.max_bytes={args.max_bytes}",
            *extra,
        ]
        began = time.perf_counter()
        # by module path, as LightningCLI imports it (benchmarks/ is on sys.path): this module's copy under that name
        cli = run([*recipe, "--trainer.callbacks+=recipe_host_profile.StepClock"])
        wall = time.perf_counter() - began
    trainer = cli.trainer
    clock = next(c for c in trainer.callbacks if type(c).__name__ == "StepClock")
    n = len(clock.starts) - 1  # the last start closes the last step
    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:])]
    actions = per_step_actions(trainer.profiler.recorded_durations, n)
    timed = range(args.warmup, n)
    C.print_result(
        {
            "benchmark": "recipe_host_profile",
            "recipe": str(RECIPE.relative_to(C.REPO)),
            "overrides": recipe[3:] + extra,
            "preset": args.preset,
            "batch": [args.batch_size, args.seq_len],
            "warmup": args.warmup,
            # MeshMonitor times the steps between logging steps: what the recipe's MFU reads
            "between_logging_steps": summary(steps, actions, [i for i in timed if not clock.logs[i]]),
            "logging_steps": summary(steps, actions, [i for i in timed if clock.logs[i]]),
            "wall_s": wall,
            "environment": C.environment(),
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
