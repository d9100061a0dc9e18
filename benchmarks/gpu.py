"""One GPU: lit-mesh (Trainer + MeshStrategy) against a hand-written PyTorch loop on the same model.

Trains the zoo GPT (default preset llama3.2-1b on a GPU, tiny on CPU) in bf16-mixed with compiled blocks
(and optionally activation checkpointing), alternating in one process, --rounds times: a Lightning run
(Trainer + MeshStrategy(compile_blocks=True)) and a plain loop on the same model, weights, batches and kernels
(torch.compile of each block's forward, autocast bf16, fused AdamW on CUDA, foreach on CPU). Each run times
its last --steps steps after --warmup steps (compilation, allocator warm-up) between two device
synchronisations. Prints tokens/s, MFU (model FLOPs per token x tokens/s / the card's dense bf16 peak,
lit_mesh/monitor/peak_flops.py, or --peak-flops), peak memory (torch.cuda.max_memory_allocated), the ratio
lit-mesh / hand loop (median over rounds) and the card's name, as one JSON line.

    python benchmarks/gpu.py                                # on one GPU
    python benchmarks/gpu.py --preset tiny --steps 3 --warmup 1 --rounds 1 --compile-backend aot_eager  # CPU smoke

--float8 RECIPE compares lit-mesh in bf16-mixed against lit-mesh with the blocks' linears in float8
(MeshStrategy(float8=RECIPE), torchao; emulated, so slower, where the device has no float8 matmul) instead of the hand
loop; --n-layers cuts a preset's depth (8 layers of llama3-8b's width fit one GPU):

    python benchmarks/gpu.py --float8 tensorwise                               # the 1B preset
    python benchmarks/gpu.py --float8 tensorwise --preset llama3-8b --n-layers 8 --batch-size 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lit_mesh import MeshStrategy  # noqa: E402 (importable once _common has put the repo on sys.path)
from lit_mesh.monitor.peak_flops import peak_bf16_flops  # noqa: E402
from zoo.flops import gpt_flops_per_token  # noqa: E402
from zoo.gpt import GPT  # noqa: E402
from zoo.modules import GPTModule  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3.2-1b" if cuda else "tiny")
    p.add_argument("--batch-size", type=int, default=4 if cuda else 2)
    p.add_argument("--seq-len", type=int, default=2048 if cuda else 32)
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--rounds", type=int, default=3, help="lit-mesh / hand loop alternations")
    p.add_argument("--compile-backend", default="inductor", help='torch.compile backend; "none": no compile')
    p.add_argument("--activation-checkpointing", default="none", choices=["none", "full", "selective"])
    p.add_argument("--float8", default="none", choices=["none", "tensorwise", "rowwise"], help="against bf16-mixed")
    p.add_argument("--n-layers", type=int, default=None, help="the preset's depth cut to this many blocks")
    p.add_argument("--peak-flops", type=float, default=None, help="dense bf16 FLOP/s of the device (default: table)")
    return p.parse_args(argv)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    # fused: the fast CUDA path; foreach elsewhere (fused AdamW needs a GPU for bf16/fp32 on this torch)
    fast = {"fused": True} if torch.cuda.is_available() else {"foreach": True}
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, **fast)


class BenchModule(GPTModule):
    """The zoo GPTModule with the hand loop's optimizer."""

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.parameters())


class WindowTimer(Callback):
    """Seconds from the start of step `warmup` to the end of training, between two device synchronisations."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.seconds = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            synchronize()
            self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        synchronize()
        assert self.start is not None
        self.seconds = time.perf_counter() - self.start


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def bench_module(args: argparse.Namespace) -> BenchModule:
    overrides = {"n_layers": args.n_layers} if args.n_layers is not None else None
    return BenchModule(preset=args.preset, config_overrides=overrides)


def lit_mesh_float8_run(args: argparse.Namespace, batches: list[C.Batch]) -> tuple[float, float | None]:
    """lit_mesh_run with the blocks' linears in float8 (--float8)."""
    return lit_mesh_run(args, batches, float8=args.float8)


def lit_mesh_run(
    args: argparse.Namespace, batches: list[C.Batch], float8: str | None = None
) -> tuple[float, float | None]:
    """(seconds of the timed steps, peak GiB) of Trainer + MeshStrategy on one device."""
    reset_peak_memory()
    L.seed_everything(0, verbose=False)
    timer = WindowTimer(args.warmup)
    strategy = MeshStrategy(
        compile_blocks=args.compile_backend != "none",
        compile_backend=args.compile_backend if args.compile_backend != "none" else "inductor",
        activation_checkpointing=args.activation_checkpointing,
        float8=float8,  # type: ignore[arg-type]  # argparse's choices: a recipe name
    )
    kwargs = C.trainer_kwargs(1, args.warmup + args.steps, [timer])
    kwargs.update(accelerator="auto", precision="bf16-mixed")
    trainer = L.Trainer(strategy=strategy, **kwargs)
    module = bench_module(args)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return timer.seconds, peak_memory_gib()


def hand_loop_run(args: argparse.Namespace, batches: list[C.Batch]) -> tuple[float, float | None]:
    """The same steps in plain PyTorch: no Lightning, no lit-mesh."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reset_peak_memory()
    L.seed_everything(0, verbose=False)
    model = GPT(bench_module(args).config).to(device)
    if args.compile_backend != "none":
        for block in model.layers:  # what MeshStrategy(compile_blocks=True) compiles
            block.forward = torch.compile(block.forward, backend=args.compile_backend)
    optimizer = make_optimizer(model.parameters())
    start = 0.0
    for step, (tokens, targets) in enumerate(batches[: args.warmup + args.steps]):
        if step == args.warmup:
            synchronize()
            start = time.perf_counter()
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = GPTModule.loss_fn(model(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize()
    return time.perf_counter() - start, peak_memory_gib()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    config = bench_module(args).config
    batches = C.random_batches(args.warmup + args.steps, args.batch_size, args.seq_len, config.vocab_size, seed=0)
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = args.peak_flops or (peak_bf16_flops(card) if torch.cuda.is_available() else None)
    flops_per_token = gpt_flops_per_token(config, args.seq_len)  # a tied head still runs its matmul
    with torch.device("meta"):
        params = GPT(config).num_params()  # a tied embedding/head matrix once
    tokens = args.steps * args.batch_size * args.seq_len
    rows = []
    # the hand loop has no activation checkpointing: with it, lit-mesh alone runs (compare with a run without)
    runs = (("lit_mesh", lit_mesh_run), ("hand_loop", hand_loop_run))[
        : 1 if args.activation_checkpointing != "none" else 2
    ]
    if args.float8 != "none":  # bf16-mixed against float8 linears, both through lit-mesh
        runs = (("lit_mesh", lit_mesh_run), ("lit_mesh_float8", lit_mesh_float8_run))
    for _ in range(args.rounds):
        for name, run in runs:
            seconds, memory = run(args, batches)
            rows.append(
                {
                    "run": name,
                    "seconds": seconds,
                    "tokens_per_s": tokens / seconds,
                    "peak_memory_gib": memory,
                    "mfu": tokens / seconds * flops_per_token / peak if peak else None,
                }
            )
    median = {n: statistics.median(r["tokens_per_s"] for r in rows if r["run"] == n) for n, _ in runs}
    C.print_result(
        {
            "benchmark": "gpu",
            "card": card,
            "peak_flops": peak,
            "flops_per_token": flops_per_token,
            "tokens_per_s": median,
            "ratio_lit_mesh_over_hand_loop": median["lit_mesh"] / median["hand_loop"]
            if "hand_loop" in median
            else None,
            "ratio_float8_over_bf16": median["lit_mesh_float8"] / median["lit_mesh"]
            if "lit_mesh_float8" in median
            else None,
            "mfu": {n: median[n] * flops_per_token / peak if peak else None for n in median},
            "peak_memory_gib": {
                n: max((r["peak_memory_gib"] or 0.0) for r in rows if r["run"] == n) or None for n in median
            },
            "rounds": rows,
            "goals": {"ratio": ">= 0.98", "mfu": ">= 0.45 (llama3.2-1b, one H100, bf16)"},
            "config": {
                "preset": args.preset,
                "n_layers": config.n_layers,
                "float8": args.float8,
                "params": params,
                "tie_embeddings": config.tie_embeddings,
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "steps": args.steps,
                "warmup": args.warmup,
                "precision": "bf16-mixed",
                "compile_backend": args.compile_backend,
                "activation_checkpointing": args.activation_checkpointing,
                "torch": torch.__version__,
                "lightning": L.__version__,
            },
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
