"""Step time of a transformers LlamaForCausalLM under MeshStrategy vs the zoo GPT of the same shape.

Both sides are the same network (the zoo preset's config converted with zoo.convert: same weights shapes,
RMSNorm, RoPE, GQA, SwiGLU), the same mesh, batch shapes, fp32 and AdamW, trained by MeshStrategy through a
Trainer; only the module code and the plan differ (transformers' own TP plan + our SP for Llama: the token
embedding's output is all-reduced whole and the first layer slices the sequence, where the zoo GPT
reduce-scatters; transformers also builds masks and rotary tables every step). Runs alternate
(hf, zoo, zoo, hf, ...) in the same processes; warm-up steps dropped; a step is on_train_batch_start ->
on_train_batch_end.

    python benchmarks/hf.py                    # 4 ranks: dp=2 x tp=2, preset small
    python benchmarks/hf.py --dp 2 --tp 1      # 2 ranks: FSDP only

Result: ratio = median step time (transformers Llama) / median step time (zoo GPT); figures only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import torch
import torch.distributed as dist


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_timing_arguments(p, repeats=2, timeout=400.0)  # --preset: the Llama gets the zoo preset's converted config
    return p.parse_args(argv)


class BenchLlamaModule(C.BenchGPTModule):
    """The zoo GPTModule with its network swapped for transformers' LlamaForCausalLM of the same config."""

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaForCausalLM

            from zoo.convert.llama import to_llama_config

            self.model = LlamaForCausalLM(to_llama_config(self.config))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def training_step(self, batch: C.Batch, batch_idx: int) -> torch.Tensor:
        # BenchGPTModule calls loss_of(self.model, ...): transformers' model returns an output object, not logits
        tokens, targets = batch
        return self.loss_fn(self(tokens), targets)


def run(args: argparse.Namespace, module_class: type, world_size: int) -> list[float]:
    import lightning as L

    from lit_mesh import MeshStrategy

    timer = C.StepTimer()
    module = module_class(args.preset)
    strategy = MeshStrategy(dp=args.dp, tp=args.tp, process_group_backend="gloo")
    trainer = L.Trainer(strategy=strategy, **C.trainer_kwargs(world_size, args.warmup + args.steps, [timer]))
    loader = C.batch_loader(args.warmup + args.steps, args.dp, args.batch_size, args.seq_len, module.config.vocab_size)
    trainer.fit(module, loader)
    return timer.step_times(args.warmup)


def worker(args: argparse.Namespace) -> None:
    world_size = args.dp * args.tp
    dist.init_process_group("gloo")  # Lightning finds it initialised and reuses it
    if dist.get_world_size() != world_size:
        raise SystemExit(f"dp={args.dp} x tp={args.tp} needs {world_size} processes, got {dist.get_world_size()}")
    runs: dict[str, list[list[float]]] = {"hf": [], "zoo": []}
    for r in range(args.repeats):
        order = ("hf", "zoo") if r % 2 == 0 else ("zoo", "hf")  # ABBA: a drift of the machine hits both
        for side in order:
            runs[side].append(run(args, BenchLlamaModule if side == "hf" else C.BenchGPTModule, world_size))
    gathered = {side: [C.gather(steps) for steps in per_run] for side, per_run in runs.items()}
    pooled = {side: C.slowest_rank_median([sum(ranks, []) for ranks in zip(*g)]) for side, g in gathered.items()}
    per_repeat = [
        statistics.median(max(ts) for ts in zip(*h)) / statistics.median(max(ts) for ts in zip(*z))
        for h, z in zip(gathered["hf"], gathered["zoo"])
    ]
    result: dict[str, Any] = {
        "benchmark": "hf",
        "median_step_s_transformers_llama": round(pooled["hf"], 6),
        "median_step_s_zoo_gpt": round(pooled["zoo"], 6),
        "ratio": round(pooled["hf"] / pooled["zoo"], 4),
        "ratio_per_repeat": [round(x, 4) for x in per_repeat],
        "goal": "figures only",
        "goal_met": None,
        "config": C.timing_config(
            args,
            sequence_parallel=True,
            statistic="median over steps of the slowest rank's step time, all repeats pooled",
        ),
    }
    C.emit(result)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    C.run(argv, parse_args, worker, C.launch_once(__file__, lambda args: args.dp * args.tp))


if __name__ == "__main__":
    main(sys.argv[1:])
