"""Per-rank memory of parameters, gradients and AdamW state under MeshStrategy FSDP, against the ideal.

For each N in --fsdp (default 1 2 4) one launch of N ranks trains a zoo GPT with MeshStrategy(dp=N) for one
step and counts, on every rank, the bytes it holds (the local shard of a DTensor, via .to_local()):
  params     after the step (resharded);
  grads      after the backward, before the optimizer step;
  grads_accumulating  between the 2 micro-batches of the step (accumulate_grad_batches=2), after the first
             backward: .grad plus what FSDP2 holds outside it (unsharded gradients, HSDP's pending sum);
  optimizer  AdamW exp_avg + exp_avg_sq after the step (the scalar `step` is left out).
The ideal for N is the single-device total (the N=1 run) / N; ratio = max over ranks / ideal.

Bonus (--fake-preset, "none" to skip): a large preset on N fake ranks (torch's "fake" process group and meta
tensors, nothing allocated): rank 0's parameter shards after lit_mesh's own parallelize(), i.e. the code
MeshStrategy.setup runs. Rank 0 holds the largest shard when a dim does not divide evenly. Gradients and
AdamW state have the parameters' shapes and placements in fp32, so only parameters are counted there.

    python benchmarks/memory.py
    python benchmarks/memory.py --preset tiny --fsdp 1 2 --fake-preset none

Activation memory (--ac-mesh DPxTP, default 2x2; "none" skips): in the launch of dp*tp ranks, one extra
fit per activation_checkpointing mode (none, full, selective, full with ac_every_n_blocks=2) and precision
(32-true, bf16-mixed, bf16-true) under MeshStrategy(dp, tp), one step each. Inside training_step the forward
and loss run under two probes, so the strategy's own wrapping (composable checkpoint, SAC, FSDP2) is measured:
  alive_after_forward  bytes of the storages created by the forward + loss (a TorchDispatchMode records every
                       op output; DTensors by their local tensor) still alive when the loss is returned, i.e.
                       what the step holds into backward: autograd's saved tensors, checkpointed blocks'
                       inputs, the selective-checkpoint cache, logits and loss. Storages of parameters (the
                       FSDP root's unsharded parameters, kept from forward to backward) are counted apart.
  saved_hook           unique storages packed by torch.autograd.graph.saved_tensors_hooks. A checkpointed
                       region installs its own hooks, which hide what it keeps from this one: it sees only
                       the tensors saved outside checkpointed blocks (so full and selective read the same).
peak_estimate = params + grads + optimizer + alive_after_forward + root unsharded params: an ESTIMATE (no
allocator on CPU; FSDP2 all-gather buffers of the blocks and backward temporaries are not in it).

Largest GPT in a per-rank budget (--budget-gib, default 24; "0" skips): over a family of Llama-3-style widths,
the deepest model whose per-rank bytes fit, for FSDP N in --fit-fsdp (default 1 2 4) and each AC mode:
  bytes(N) = 16 * P / N                      fp32 params + grads + AdamW exp_avg + exp_avg_sq, sharded over N
           + 4 * P_root                      the root's (embedding, norm, head) unsharded params, kept fwd->bwd
           + 2 * 4 * P_block                 two unsharded blocks (the one computing and the prefetched one)
           + A_out + L * A_block             activations of one rank's micro-batch (--fit-batch x --fit-seq)
where A_out and A_block are counted with the same dispatch-mode probe on fake tensors (FakeTensorMode, CPU
kernels, nothing allocated): A_block = A(2 layers) - A(1 layer), A_out = A(1 layer) - A_block. FSDP does not
change one rank's activations (no TP, no CP); the state terms assume 32-true or bf16-mixed (fp32 masters).

Goal: ratio <= 1.05 for every component and every N.

ZeRO stages (--zero): MeshStrategy(dp=N, zero_stage=1|2|3) against the ZeRO paper's per-rank formulas; see
benchmarks/memory_zero.py.  python benchmarks/memory.py --zero --preset small --fsdp 1 2 4

The loss alone (--loss-only, in this process, no launch): peak bytes of the storages the cross-entropy creates
(forward + its backward to the logits, counted by the same dispatch-mode probe) for --loss-tokens tokens at
vocab --loss-vocab (128256, Llama 3), fp32 and bf16 logits: F.cross_entropy(logits.float()) (the zoo's loss
before issue 21) against lit_mesh.loss.cross_entropy (chunked, --loss-chunks chunks as a GPU micro-batch of
8192 tokens has with the default 1024 rows). Goal: the chunked loss's peak <= 1/4 of the plain one's.
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
from torch.distributed.fsdp import FSDPModule

from lit_mesh.planner.fake_step import LiveStorages  # noqa: E402
from lit_mesh.planner.fake_step import local_tensor as _local  # noqa: E402
from lit_mesh.planner.fake_step import storage_key as _storage_key  # noqa: E402
from lit_mesh.planner.simulate import fake_rank_params  # noqa: E402 (importable once _common has put the repo on sys.path)
from zoo.gpt import GPT, GPTConfig  # noqa: E402

GOAL = 1.05
ACCUMULATE = 2  # micro-batches per step of the sharding runs: grads_accumulating is measured between them
COMPONENTS = ("params", "grads", "grads_accumulating", "optimizer")
AC_CONFIGS = (("none", 1), ("full", 1), ("full", 2), ("selective", 1))
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
GIB = 1024**3
# Llama-3-style widths for the budget fit: (name, dim, n_heads, ffn_hidden); vocab 128256, 8 kv heads
FIT_WIDTHS = (
    ("d2048", 2048, 32, 8192),
    ("d3072", 3072, 24, 8192),
    ("d4096", 4096, 32, 14336),
    ("d8192", 8192, 64, 28672),
)


class ActivationProbeModule(C.BenchGPTModule):
    """BenchGPTModule whose training_step measures the forward + loss under LiveStorages and a
    saved_tensors_hooks pack hook (the strategy's checkpoint contexts run inside, as in any training)."""

    def __init__(self, preset: str) -> None:
        super().__init__(preset)
        self.activation: dict[str, int] = {}

    def training_step(self, batch: C.Batch, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = _local(t)
            saved[_storage_key(local)] = local.untyped_storage().nbytes()
            return t

        # A measuring forward whose graph is dropped unused: a TorchDispatchMode active in the forward upsets the
        # selective-checkpoint recompute in backward (an op count mismatch), so backward never runs on it;
        # the step then trains on a second, unprobed forward of the same batch.
        live = LiveStorages()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), live:
            probe_loss = self.loss_fn(self(tokens), targets)
        alive = live.alive()
        params = {_storage_key(p) for p in self.parameters()}  # after forward: the root's unsharded ones
        self.activation = {
            "alive_after_forward": sum(b for k, b in alive.items() if k not in params),
            "root_unsharded_params": sum(b for k, b in alive.items() if k in params),
            "saved_hook": sum(saved.values()),
            "tokens_per_rank": tokens.numel(),
        }
        del probe_loss, live, alive
        loss = self.loss_fn(self(tokens), targets)
        return loss


class MemoryProbe(Callback):
    """Bytes this rank holds, per component."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "grads_accumulating" not in self.bytes:  # the first of ACCUMULATE micro-batches: more are to come
            self.bytes["grads_accumulating"] = gradient_bytes(pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.bytes["grads"] = sum(C.local_bytes(p.grad) for p in pl_module.parameters() if p.grad is not None)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.bytes["params"] = sum(C.local_bytes(p) for p in pl_module.parameters())
        state = trainer.optimizers[0].state
        self.bytes["optimizer"] = sum(C.local_bytes(s[k]) for s in state.values() for k in ("exp_avg", "exp_avg_sq"))


def gradient_bytes(module: torch.nn.Module) -> int:
    """Every gradient byte this rank holds: the parameters' .grad (local shards), and what FSDP2 keeps outside
    .grad between micro-batches: unsharded gradients when gradient sync is off, HSDP's pending (not yet
    all-reduced) sharded sum. Read from FSDP2's parameter groups (private: torch exposes no accessor)."""
    held: dict[int, int] = {id(p.grad): C.local_bytes(p.grad) for p in module.parameters() if p.grad is not None}
    for unit in module.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        if group is None:
            continue
        pending = [group._partial_reduce_output]
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)
            # the shard's .grad too: while a unit is gathered (ZeRO-1/2) the module's parameters are the gathered ones
            pending += [
                getattr(param, "unsharded_accumulated_grad", None),
                getattr(unsharded, "grad", None),
                param.sharded_param.grad,
            ]
        held.update({id(t): C.local_bytes(t) for t in pending if t is not None})
    return sum(held.values())


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="zoo GPT preset of the real runs")
    p.add_argument("--fsdp", type=int, nargs="+", default=[1, 2, 4], help="FSDP degrees N (one launch each)")
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--fake-preset", default="llama3-8b", help='preset for the fake-rank bonus; "none" skips it')
    p.add_argument("--fake-n", type=int, default=64, help="FSDP degree of the fake-rank bonus")
    p.add_argument(
        "--ac-mesh", default="2x2", help='DPxTP of the activation sweep (AC modes x precisions); "none" skips'
    )
    p.add_argument("--budget-gib", type=float, default=24.0, help="per-rank budget of the largest-GPT fit; 0 skips")
    p.add_argument("--fit-fsdp", type=int, nargs="+", default=[1, 2, 4], help="FSDP degrees of the largest-GPT fit")
    p.add_argument("--fit-batch", type=int, default=1, help="per-rank micro-batch of the largest-GPT fit")
    p.add_argument("--fit-seq", type=int, default=4096, help="sequence length of the largest-GPT fit")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each launch")
    p.add_argument("--loss-only", action="store_true", help="measure only the loss's peak bytes (no launch)")
    p.add_argument(
        "--zero", action="store_true", help="ZeRO stages 1, 2, 3 against the paper's formulas (memory_zero.py)"
    )
    p.add_argument("--loss-vocab", type=int, default=128256)
    p.add_argument("--loss-tokens", type=int, default=1024)
    p.add_argument("--loss-chunks", type=int, default=8)
    p.add_argument("--worker-n", type=int, default=0, help=argparse.SUPPRESS)  # set by the launcher
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One real run with MeshStrategy(dp=N); rank 0 emits every rank's bytes."""
    from lit_mesh import MeshStrategy

    n = args.worker_n
    dist.init_process_group("gloo")  # Lightning finds it initialised and reuses it
    probe = MemoryProbe()
    module = C.BenchGPTModule(args.preset)
    trainer = L.Trainer(
        strategy=MeshStrategy(dp=n, process_group_backend="gloo"),
        accumulate_grad_batches=ACCUMULATE,
        **C.trainer_kwargs(n, 1, [probe]),
    )
    trainer.fit(module, C.batch_loader(ACCUMULATE, n, args.batch_size, args.seq_len, module.config.vocab_size))
    numel = sum(p.numel() for p in module.parameters())  # global (DTensor) sizes
    result = {"per_rank": C.gather(probe.bytes), "global_numel": numel, "layout": trainer.strategy.layout.describe()}
    ac_dp, ac_tp = ac_mesh(args.ac_mesh)
    if ac_dp * ac_tp == n:
        result["activations"] = activation_sweep(args, ac_dp, ac_tp)
    C.emit(result)
    dist.destroy_process_group()


def ac_mesh(text: str) -> tuple[int, int]:
    if text == "none":
        return 0, 0
    dp, tp = (int(x) for x in text.lower().split("x"))
    return dp, tp


def activation_sweep(args: argparse.Namespace, dp: int, tp: int) -> list[dict[str, Any]]:
    """One step per (AC mode, precision) under MeshStrategy(dp, tp); every rank's figures."""
    from lit_mesh import MeshStrategy

    rows = []
    for mode, every in AC_CONFIGS:
        for precision in PRECISIONS:
            print(f"activation sweep: ac={mode} every={every} precision={precision}", file=sys.stderr, flush=True)
            probe = MemoryProbe()
            module = ActivationProbeModule(args.preset)
            strategy = MeshStrategy(
                dp=dp, tp=tp, activation_checkpointing=mode, ac_every_n_blocks=every, process_group_backend="gloo"
            )
            kwargs = {**C.trainer_kwargs(dp * tp, 1, [probe]), "precision": precision}
            trainer = L.Trainer(strategy=strategy, **kwargs)
            row: dict[str, Any] = {"activation_checkpointing": mode, "ac_every_n_blocks": every, "precision": precision}
            try:  # every rank fails alike (same graph, same recompute), so each one records it and goes on
                trainer.fit(module, C.batch_loader(1, dp, args.batch_size, args.seq_len, module.config.vocab_size))
            except RuntimeError as err:
                row["error"] = str(err).split(". ")[0][:200]
            else:
                row["per_rank"] = C.gather({**probe.bytes, **module.activation})
            rows.append(row)
    return rows


def summarize_activations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Max over ranks of each figure, and the labelled peak estimate."""
    out = []
    for row in rows:
        if "error" in row:
            out.append(row)
            continue
        ranks = row["per_rank"]
        keys = [*COMPONENTS, "alive_after_forward", "root_unsharded_params", "saved_hook"]
        entry = {k: row[k] for k in ("activation_checkpointing", "ac_every_n_blocks", "precision")}
        entry.update({f"max_{k}_bytes": max(r[k] for r in ranks) for k in keys})
        # per rank: params + grads + optimizer + activations + root unsharded params; the worst rank
        entry["peak_estimate_bytes"] = max(
            sum(r[k] for k in (*COMPONENTS, "alive_after_forward", "root_unsharded_params")) for r in ranks
        )
        entry["tokens_per_rank"] = ranks[0]["tokens_per_rank"]
        out.append(entry)
    return out


def _meta_numel(config: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def fake_activation_bytes(config: GPTConfig, mode: str, batch: int, seq: int) -> int:
    """Bytes the forward + loss of `config` keeps for backward on one rank (no TP), counted on fake tensors
    with the same probe as the real runs, activation checkpointing applied by lit_mesh."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lit_mesh.parallel.activation_checkpointing import apply_activation_checkpointing

    with FakeTensorMode():
        gpt = GPT(config)
        apply_activation_checkpointing(list(gpt.layers), mode)
        tokens = torch.randint(0, config.vocab_size, (batch, seq))
        live = LiveStorages()
        with live:
            loss = C.BenchGPTModule.loss_fn(gpt(tokens), tokens)
        params = {_storage_key(p) for p in gpt.parameters()}
        alive = sum(b for k, b in live.alive().items() if k not in params)
        del loss
    return alive


def largest_fit(args: argparse.Namespace) -> dict[str, Any]:
    """The deepest model of each width that fits the budget, per FSDP degree and AC mode (formula in the doc)."""
    budget = args.budget_gib * GIB
    modes = ("none", "full", "selective")
    widths = []
    for name, dim, heads, ffn in FIT_WIDTHS:
        shape = dict(
            vocab_size=128256,
            dim=dim,
            n_heads=heads,
            n_kv_heads=8,
            ffn_hidden=ffn,
            rope_theta=500000.0,
            max_seq_len=max(8192, args.fit_seq),
        )
        one, two = (_meta_numel(GPTConfig(n_layers=k, **shape)) for k in (1, 2))
        p_block = two - one
        p_root = one - p_block
        acts = {}
        for mode in modes:
            a1, a2 = (
                fake_activation_bytes(GPTConfig(n_layers=k, **shape), mode, args.fit_batch, args.fit_seq)
                for k in (1, 2)
            )
            acts[mode] = {"A_block": a2 - a1, "A_out": a1 - (a2 - a1)}
        widths.append({"name": name, "shape": shape, "P_block": p_block, "P_root": p_root, "activations": acts})
    fits: dict[str, Any] = {}
    for n in args.fit_fsdp:
        for mode in modes:
            best = None
            for w in widths:
                a = w["activations"][mode]
                fixed = 16 * w["P_root"] / n + 4 * w["P_root"] + 8 * w["P_block"] + a["A_out"]
                per_layer = 16 * w["P_block"] / n + a["A_block"]
                layers = int((budget - fixed) // per_layer) if budget > fixed else 0
                if layers < 1:
                    continue
                params = w["P_root"] + layers * w["P_block"]
                if best is None or params > best["params"]:
                    best = {
                        "width": w["name"],
                        "n_layers": layers,
                        "params": params,
                        "per_rank_bytes": fixed + layers * per_layer,
                        "state_bytes": 16 * params / n,
                        "activation_bytes": a["A_out"] + layers * a["A_block"],
                    }
            fits[f"fsdp{n}/{mode}"] = best
    return {
        "budget_gib": args.budget_gib,
        "fit_batch": args.fit_batch,
        "fit_seq": args.fit_seq,
        "precision": "32-true (bf16-mixed: same fp32 state; activations would be smaller)",
        "widths": widths,
        "largest": fits,
    }


LOSS_GOAL = 0.25


def loss_peak_bytes(args: argparse.Namespace) -> dict[str, Any]:
    """Peak bytes created by the loss (forward, then backward to the logits): plain against chunked."""
    from lit_mesh.loss import cross_entropy

    def plain(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float(), targets)

    def chunked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets, chunk_rows=args.loss_tokens // args.loss_chunks)

    n, v = args.loss_tokens, args.loss_vocab
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the allocator's peak is recorded too
    targets = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(0)).to(device)
    rows: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(n, v, generator=torch.Generator().manual_seed(1)).to(device, dtype).requires_grad_()
        row: dict[str, Any] = {"logits_bytes": logits.numel() * logits.element_size()}
        for name, loss_fn in (("plain", plain), ("chunked", chunked)):
            peak = C.PeakStorages(existing=[logits])
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            with peak:
                loss = loss_fn(logits, targets)
                (grad,) = torch.autograd.grad(loss, logits)
            row[name] = {"peak_bytes": peak.peak, "loss": loss.item()}
            if device == "cuda":
                row[name]["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated() - before
            del loss, grad
        row["ratio"] = round(row["chunked"]["peak_bytes"] / row["plain"]["peak_bytes"], 4)
        rows[str(dtype).removeprefix("torch.")] = row
    return {
        "benchmark": "memory_loss",
        "loss_device": device,
        "tokens": n,
        "vocab": v,
        "chunks": args.loss_chunks,
        "by_dtype": rows,
        "goal": f"chunked peak <= {LOSS_GOAL} x plain peak (bf16 logits, as a GPU's bf16-mixed head gives)",
        "goal_met": rows["bfloat16"]["ratio"] <= LOSS_GOAL,
        "counted": "storages created by the loss forward and its backward to the logits (dispatch-mode probe)",
        **C.environment(),
    }


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    """The launching process: one launch per FSDP degree, then each component against the ideal."""
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
            entry[comp] = {
                "per_rank_bytes": values,
                "max_bytes": max(values),
                "ideal_bytes": ideal,
                "ratio": round(ratio, 4),
            }
        per_n[str(n)] = entry
    result: dict[str, Any] = {
        "benchmark": "memory",
        "single_device_bytes": single,
        # cross-check: fp32 parameters are 4 bytes each, AdamW keeps two moments per parameter
        "expected_single_device_bytes": {
            "params": 4 * runs[1]["global_numel"],
            "grads": 4 * runs[1]["global_numel"],
            "grads_accumulating": 4 * runs[1]["global_numel"],
            "optimizer": 8 * runs[1]["global_numel"],
        },
        "fsdp": per_n,
        "max_ratio": max(per_n[k][c]["ratio"] for k in per_n for c in COMPONENTS),
        "goal": f"max over ranks / (single-device / N) <= {GOAL} for params, grads and optimizer, every N",
        "goal_met": goal_met,
    }
    if args.fake_preset != "none":
        result["fake"] = fake_rank_params(args.fake_preset, args.fake_n)
    act_runs = [run["activations"] for run in runs.values() if "activations" in run]
    if act_runs:
        dp, tp = ac_mesh(args.ac_mesh)
        result["activations"] = {
            "mesh": f"MeshStrategy(dp={dp}, tp={tp}), sequence_parallel=True",
            "preset": args.preset,
            "batch_size_per_dp_rank": args.batch_size,
            "seq_len": args.seq_len,
            "alive_after_forward": "bytes of forward+loss outputs alive when training_step returns (held for"
            " backward), parameters excluded; max over ranks",
            "saved_hook": "saved_tensors_hooks outside checkpointed regions only (checkpoint hides its own)",
            "peak_estimate": "ESTIMATE = params + grads + optimizer + alive_after_forward + root unsharded params,"
            " worst rank; FSDP all-gather buffers and backward temporaries not included",
            "cuda_max_memory_allocated": None if not torch.cuda.is_available() else "not measured: this run is CPU",
            "rows": summarize_activations(act_runs[0]),
        }
    elif args.ac_mesh != "none":
        result["activations"] = {"skipped": f"--ac-mesh {args.ac_mesh}: dp*tp is none of --fsdp {args.fsdp}"}
    if args.budget_gib > 0:
        result["largest_fit"] = largest_fit(args)
    result["config"] = {
        "world_sizes": sorted(runs),
        "mesh": "MeshStrategy(dp=N): dp_shard=N",
        "preset": args.preset,
        "batch_size_per_rank": args.batch_size,
        "seq_len": args.seq_len,
        "steps": 1,
        "accumulate_grad_batches": ACCUMULATE,
        "precision": "32-true",
        "optimizer": "AdamW(foreach)",
        "counted": "local shards (DTensor.to_local()), unpadded",
        **C.environment(),
        "threads_per_rank": 1,  # the launcher sets OMP_NUM_THREADS=1 in every rank
    }
    C.print_result(result)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.loss_only:  # one process, no ranks
        C.print_result(loss_peak_bytes(args))
        return
    if args.zero:
        import memory_zero

        C.run(argv, parse_args, memory_zero.worker, lambda a, v: memory_zero.drive(a, v, __file__))
        return
    C.run(argv, parse_args, worker, drive)


if __name__ == "__main__":
    main(sys.argv[1:])
