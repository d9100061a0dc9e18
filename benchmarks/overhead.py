"""Step-time overhead of MeshStrategy over a plain PyTorch loop with the same FSDP2 x TP by hand.

Both sides train zoo.gpt.GPT with the same parallelism, batch shapes, fp32 precision and AdamW. Runs are
interleaved in the same processes (mesh, plain, plain, mesh, ...) so that machine noise hits both. A step is
forward + backward + optimizer step + zero_grad: on the Lightning side the window between
on_train_batch_start and on_train_batch_end, on the plain side the same four calls. Warm-up steps are
dropped; no barrier is taken inside the measurement.

    python benchmarks/overhead.py                    # 4 ranks: dp=2 x tp=2, preset small
    python benchmarks/overhead.py --dp 1 --tp 2      # 2 ranks: TP/SP only
    python benchmarks/overhead.py --dp 2 --tp 1      # 2 ranks: FSDP only

Result: ratio = median step time (MeshStrategy) / median step time (plain loop); goal ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

GOAL = 1.05


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_timing_arguments(p, repeats=4, timeout=170.0)
    p.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    p.add_argument("--log-loss", action="store_true", help="keep GPTModule's per-step self.log(sync_dist=True)")
    return p.parse_args(argv)


def mesh_run(args: argparse.Namespace, world_size: int) -> list[float]:
    """One Trainer.fit with MeshStrategy; this rank's measured step times."""
    import lightning as L

    from lit_mesh import MeshStrategy

    timer = C.StepTimer()
    module = C.BenchGPTModule(args.preset, log_loss=args.log_loss)
    strategy = MeshStrategy(
        dp=args.dp, tp=args.tp, sequence_parallel=args.sequence_parallel, process_group_backend="gloo"
    )
    trainer = L.Trainer(strategy=strategy, **C.trainer_kwargs(world_size, args.warmup + args.steps, [timer]))
    loader = C.batch_loader(args.warmup + args.steps, args.dp, args.batch_size, args.seq_len, module.config.vocab_size)
    trainer.fit(module, loader)
    return timer.step_times(args.warmup)


def plain_run(args: argparse.Namespace, mesh: DeviceMesh) -> list[float]:
    """The same training by hand; this rank's measured step times."""
    gpt = C.meta_gpt(args.preset)
    C.hand_parallelize(gpt, mesh["dp"], mesh["tp"], args.sequence_parallel)
    C.materialize_gpt(gpt)
    gpt.train()
    optimizer = C.make_optimizer(gpt.parameters())
    dp_rank = mesh["dp"].get_local_rank()
    batches = C.random_batches(args.warmup + args.steps, args.batch_size, args.seq_len, gpt.config.vocab_size, dp_rank)
    times: list[float] = []
    for tokens, targets in batches:
        start = time.perf_counter()
        loss = C.GPTModule.loss_fn(gpt(tokens), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times[args.warmup :]


def worker(args: argparse.Namespace) -> None:
    world_size = args.dp * args.tp
    dist.init_process_group("gloo")  # Lightning finds it initialised and reuses it
    if dist.get_world_size() != world_size:
        raise SystemExit(f"dp={args.dp} x tp={args.tp} needs {world_size} processes, got {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    plain_steps: list[list[float]] = []
    mesh_by_rank: list[list[float]] = []
    for r in range(args.repeats):
        # ABBA order: a slow drift of the machine hurts both sides equally
        order = ("mesh", "plain") if r % 2 == 0 else ("plain", "mesh")
        for side in order:
            if side == "mesh":
                mesh_by_rank.append(mesh_run(args, world_size))
            else:
                plain_steps.append(plain_run(args, mesh))
    mesh_steps = [t for run in mesh_by_rank for t in run]
    plain_flat = [t for run in plain_steps for t in run]
    all_mesh, all_plain = C.gather(mesh_steps), C.gather(plain_flat)  # after timing: no barrier inside it
    median_mesh = C.slowest_rank_median(all_mesh)
    median_plain = C.slowest_rank_median(all_plain)
    ratio = median_mesh / median_plain
    # per-repeat ratios show how much of the figure is noise
    per_repeat = [
        statistics.median(max(ts) for ts in zip(*C.gather(m))) / statistics.median(max(ts) for ts in zip(*C.gather(p)))
        for m, p in zip(mesh_by_rank, plain_steps)
    ]
    result: dict[str, Any] = {
        "benchmark": "overhead",
        "median_step_s_mesh": round(median_mesh, 6),
        "median_step_s_plain": round(median_plain, 6),
        "ratio": round(ratio, 4),
        "ratio_per_repeat": [round(x, 4) for x in per_repeat],
        "rank0_median_step_s": {
            "mesh": round(statistics.median(mesh_steps), 6),
            "plain": round(statistics.median(plain_flat), 6),
        },
        "goal": f"ratio <= {GOAL}",
        "goal_met": ratio <= GOAL,
        "config": C.timing_config(
            args,
            sequence_parallel=args.sequence_parallel,
            optimizer="AdamW(foreach)",
            log_loss=args.log_loss,
            statistic="median over steps of the slowest rank's step time, all repeats pooled",
        ),
    }
    C.emit(result)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    C.run(argv, parse_args, worker, C.launch_once(__file__, lambda args: args.dp * args.tp))


if __name__ == "__main__":
    main(sys.argv[1:])
