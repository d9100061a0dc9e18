"""Shared pieces of the benchmark scripts: launching ranks, the result line, the hand-written FSDP2 x TP
baseline, the step timer and the batches.

Launching: `python benchmarks/x.py ...` re-runs itself under torchrun with N processes (so a script never
depends on Lightning's own launcher re-running sys.argv). The ranks' output goes to stderr; rank 0 writes its
result to a file and the launching process prints it as the ONE JSON line at the end of stdout. Run directly
under torchrun, rank 0 prints the JSON line itself.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import ArgumentParser, Namespace
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/, not the repo, on sys.path
    sys.path.insert(0, str(REPO))

from lit_mesh.parallel.pipeline.api import loss_of  # noqa: E402
from zoo.gpt import GPT, GPTConfig  # noqa: E402
from zoo.modules import GPTModule  # noqa: E402

_RESULT_ENV = "LIT_MESH_BENCH_RESULT"
_LAUNCHER_ENV = "LIT_MESH_BENCH_LAUNCHER"  # torchrun (default) or fork
Batch = tuple[torch.Tensor, torch.Tensor]


# ---- launching -------------------------------------------------------------------------------------------


def in_worker() -> bool:
    """True inside a rank started by torchrun."""
    return "LOCAL_RANK" in os.environ


def launch(script: str, argv: Sequence[str], nproc: int, timeout: float) -> dict[str, Any]:
    """Run `script argv` on `nproc` torchrun ranks and return the result dict rank 0 wrote.

    With LIT_MESH_BENCH_LAUNCHER=fork the ranks are forked from this process instead (the smoke test,
    tests/integration/test_benchmarks_smoke.py: the imports are paid once for every script and rank)."""
    launcher = os.environ.get(_LAUNCHER_ENV, "torchrun")
    if launcher not in ("torchrun", "fork"):
        raise ValueError(f"{_LAUNCHER_ENV}={launcher!r}: choose torchrun or fork")
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        if launcher == "fork":
            return _fork_launch(script, argv, nproc, result_path)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            script,
            *argv,
        ]
        # one thread per rank: the ranks already share the few cores; more threads only oversubscribe them
        env = {
            **os.environ,
            _RESULT_ENV: str(result_path),
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        # the ranks' chatter goes to stderr so that stdout ends with the one JSON line
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout, cwd=REPO)
        if proc.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        return json.loads(result_path.read_text())


def _fork_launch(script: str, argv: Sequence[str], nproc: int, result_path: Path) -> dict[str, Any]:
    """`launch` with the ranks forked from this process (fork_ranks)."""
    environment = {**os.environ, _RESULT_ENV: str(result_path), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    code = fork_ranks(script, argv, nproc, environment)
    if code != 0 or not result_path.exists():
        raise RuntimeError(f"{script} {' '.join(argv)} on {nproc} forked ranks failed with exit code {code}")
    return json.loads(result_path.read_text())


def fork_ranks(script: str, argv: Sequence[str], nproc: int, environment: dict[str, str]) -> int:
    """Run `script argv` as __main__ on `nproc` ranks forked from this process, each with `environment` and the
    variables torchrun sets (tests/fork_launch.py); 0 when every rank exits 0. The ranks' stdout goes to stderr, as
    in `launch`. No timeout of its own: the smoke test times its whole run. Fork-safe only while this process runs
    one intra-op thread (the smoke runner, tests/workers/benchmark_smoke.py, sets OMP_NUM_THREADS=1)."""
    from tests.fork_launch import _run_rank, _torchrun_environment, _wait
    from tests.launch import free_port

    shared = {**environment, **_torchrun_environment(nproc, free_port())}
    sys.stdout.flush()  # what is buffered now must not be written again by every rank
    sys.stderr.flush()
    children = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)
            _run_rank(
                {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}, script, list(argv)
            )
        children[pid] = rank
    return _wait(children)


def run(
    argv: list[str],
    parse_args: Callable[[list[str]], Namespace],
    worker: Callable[[Namespace], None],
    drive: Callable[[Namespace, list[str]], None],
    one_thread: bool = False,
) -> None:
    """A benchmark's `main`: inside a torchrun rank `worker(args)`, in the launching process `drive(args, argv)`."""
    args = parse_args(argv)
    if in_worker():
        if one_thread:  # the ranks already share the few cores; more threads only oversubscribe them
            torch.set_num_threads(1)
        worker(args)
    else:
        drive(args, argv)


def launch_once(script: str, nproc: Callable[[Namespace], int]) -> Callable[[Namespace, list[str]], None]:
    """The `drive` of a benchmark that launches its ranks once and prints rank 0's result as the JSON line."""
    return lambda args, argv: print_result(launch(script, argv, nproc(args), args.timeout))


def emit(result: dict[str, Any]) -> None:
    """Rank 0 only: hand the result to the launcher, or print it when run under torchrun directly."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = os.environ.get(_RESULT_ENV)
    if path:
        Path(path).write_text(json.dumps(result))
    else:
        print(json.dumps(result), flush=True)


def print_result(result: dict[str, Any]) -> None:
    """The launching process's last line of stdout."""
    print(json.dumps(result), flush=True)


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "device": "cpu",
        "backend": "gloo",
        "cpu_count": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def gather(value: Any) -> list[Any]:
    """Every rank's `value` (a collective outside any timed window)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# ---- model, data, timing -------------------------------------------------------------------------------


class BenchGPTModule(GPTModule):
    """The zoo GPTModule; `log_loss=False` drops its per-step `self.log(..., sync_dist=True)`, an all-reduce
    of the loss that the hand-written loop does not do (it is the module's cost, not the strategy's)."""

    def __init__(self, preset: str, log_loss: bool = False) -> None:
        super().__init__(preset=preset)
        self.log_loss = log_loss

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        if self.log_loss:
            return super().training_step(batch, batch_idx)
        tokens, targets = batch
        return loss_of(self.model, self.loss_fn, tokens, targets)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    """The optimizer GPTModule configures by default (lr 3e-3, betas (0.9, 0.95), no weight decay, foreach)."""
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)


def random_batches(n: int, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> list[Batch]:
    """`n` batches of random tokens: the content does not change the step time, only the shapes do."""
    gen = torch.Generator().manual_seed(seed)
    windows = torch.randint(0, vocab_size, (n, batch_size, seq_len + 1), generator=gen)
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]


def batch_loader(n: int, dp: int, batch_size: int, seq_len: int, vocab_size: int) -> torch.utils.data.DataLoader:
    """A map-style loader of n * dp samples; Lightning's DistributedSampler gives each dp rank n batches."""
    samples = random_batches(1, n * dp * batch_size, seq_len, vocab_size, seed=0)[0]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*samples), batch_size=batch_size)


class StepTimer(Callback):
    """Per-step wall times on this rank: on_train_batch_start -> on_train_batch_end (forward, backward,
    optimizer step and zero_grad all happen in between). No barrier: each rank reads its own clock."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.starts.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.ends.append(time.perf_counter())

    def step_times(self, warmup: int) -> list[float]:
        return [e - s for s, e in zip(self.starts[warmup:], self.ends[warmup:])]

    def window(self, warmup: int) -> float:
        """Wall time of the measured steps including everything between them (data loading, hooks)."""
        return self.ends[-1] - self.ends[warmup - 1] if warmup else self.ends[-1] - self.starts[0]


def add_timing_arguments(p: ArgumentParser, repeats: int, timeout: float) -> None:
    """The arguments of the step-timing benchmarks (overhead, vs_modelparallel, hf): mesh, model, batch, steps."""
    p.add_argument("--dp", type=int, default=2, help="FSDP degree (dp_shard)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--preset", default="small", help="zoo GPT preset")
    p.add_argument("--batch-size", type=int, default=4, help="per dp rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every run")
    p.add_argument("--repeats", type=int, default=repeats, help="runs of each side, interleaved")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds for the whole launch")


def timing_config(args: Namespace, **extra: Any) -> dict[str, Any]:
    """The `config` of a step-timing result: the run's shape (add_timing_arguments), then `extra`, then the machine."""
    return {
        "world_size": args.dp * args.tp,
        "mesh": {"dp_shard": args.dp, "tp": args.tp},
        "preset": args.preset,
        "batch_size_per_dp_rank": args.batch_size,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "precision": "32-true",
        **extra,
        **environment(),
    }


def trainer_kwargs(world_size: int, max_steps: int, callbacks: list[Callback]) -> dict[str, Any]:
    """A Trainer that only trains: no logger, progress bar, summary, checkpoint or validation."""
    return dict(
        accelerator="cpu",
        devices=world_size,
        num_nodes=1,
        max_steps=max_steps,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )


def slowest_rank_median(per_rank_steps: list[list[float]]) -> float:
    """Median over steps of the slowest rank's time at each step (the ranks wait for each other anyway)."""
    return statistics.median(max(times) for times in zip(*per_rank_steps))


# ---- the hand-written FSDP2 x TP baseline ---------------------------------------------------------------


def hand_tp_plan(sequence_parallel: bool) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """torch ParallelStyles for zoo.gpt.GPT written out by hand (torchtitan's Llama plan): (root, per block)."""
    seq = Shard(1)  # activations are (batch, sequence, features)
    between = seq if sequence_parallel else Replicate()
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Replicate(), use_local_output=True),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
        root["norm"] = SequenceParallel()
        block.update(
            {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": gather,
                "feed_forward": gather,
            }
        )
    return root, block


def hand_parallelize(gpt: GPT, dp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None, sequence_parallel: bool) -> None:
    """TP/SP with torch's parallelize_module, then fully_shard each block, then the root (fp32, resharding)."""
    if tp_mesh is not None and tp_mesh.size() > 1:
        root_plan, block_plan = hand_tp_plan(sequence_parallel)
        parallelize_module(gpt, tp_mesh, root_plan)
        for block in gpt.layers:
            parallelize_module(block, tp_mesh, block_plan)
    if dp_mesh is not None and dp_mesh.size() > 1:
        for block in gpt.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(gpt, mesh=dp_mesh)


def meta_gpt(preset: str) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig.from_preset(preset))


def materialize_gpt(gpt: GPT) -> None:
    """Allocate the (sharded) weights and give them the zoo's initialisation."""
    from lit_mesh.init import init_parameters

    gpt.to_empty(device="cpu")
    init_parameters(gpt, gpt.parallel_plan().init, seed=0)


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for `tensor`: the local shard of a DTensor."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class PeakStorages(TorchDispatchMode):
    """The peak, over the ops run while active, of the bytes of storages created inside and still alive.
    `existing`: tensors made before, whose storages a view made inside must not count."""

    def __init__(self, existing: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.existing = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                t = t._local_tensor if hasattr(t, "_local_tensor") else t
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.existing:
                    self.refs.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.refs = {key: (ref, n) for key, (ref, n) in self.refs.items() if not ref.expired()}
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out
