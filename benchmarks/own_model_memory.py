"""A user's own 12-block transformer (no parallel_plan()) under MeshStrategy(dp=4): per-rank peak parameter bytes
during forward with one FSDP unit for the whole model (what lit-mesh did before issue #38; here
auto_wrap_policy=set()) against the per-block units it now finds by itself; and CPU offload's placement.

Counted on every rank, at each parameterised leaf module's forward (FSDP2 gathers a unit before it runs): the local
shards of every parameter, plus the full size of every parameter whose unit is gathered at that moment (all-gather
output allocated: prefetched units count too). Goal: per-block peak <= (1/4 + 2/12) x the full parameter bytes.
CPU offload (cpu_offload=True, FSDP2's CPUOffloadPolicy): the device of every parameter shard, gradient and AdamW
state after one step; on CPU ranks every byte is on the host trivially, so the placement check here is that each
FSDP unit carries the offload policy; on GPUs the script also reports the device bytes of the same run without
cpu_offload (per-block units), so the two can be set side by side (the goal with offload: 0).

Usage: python benchmarks/own_model_memory.py [--dim 256] [--timeout 900]   (prints one JSON object last)
       python benchmarks/own_model_memory.py --offload-only   (CPU offload alone: on GPUs, dp = the visible GPUs,
       at least 2; benchmarks/gpu_checks.sh's step own_model_offload)
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from lit_mesh import MeshStrategy

N_BLOCKS, N_RANKS, VOCAB, SEQ = 12, 4, 64, 16
GOAL = 1 / N_RANKS + 2 / N_BLOCKS


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.heads = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(N_BLOCKS))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def held_parameter_bytes(root: nn.Module) -> int:
    """This rank's parameter bytes now: the shards, plus every parameter of a unit gathered now."""
    total = 0
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else []:
            shard = fsdp_param.sharded_param.to_local()
            total += shard.numel() * shard.element_size()
            gathered = any(t.untyped_storage().size() > 0 for t in fsdp_param.all_gather_outputs)
            if gathered:
                total += fsdp_param._orig_size.numel() * shard.element_size()
    return total


class OwnModule(L.LightningModule):
    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Transformer(dim)
        self.peak = 0

    def on_fit_start(self) -> None:
        def measure(*_: Any) -> None:
            self.peak = max(self.peak, held_parameter_bytes(self))

        for module in self.model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(measure)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.randint(0, VOCAB, (8, SEQ + 1)), batch_size=2)


def ranks(args: argparse.Namespace) -> int:
    """dp=4 on CPU ranks; with --offload-only on GPUs, one rank per visible GPU (FSDP needs 2 or more)."""
    if not (args.offload_only and torch.cuda.is_available()):
        return N_RANKS
    if torch.cuda.device_count() < 2:
        raise SystemExit(
            f"--offload-only on GPUs needs 2 or more (FSDP shards over ranks); {torch.cuda.device_count()} visible"
        )
    return min(N_RANKS, torch.cuda.device_count())


def fit(dim: int, n_ranks: int = N_RANKS, **strategy: Any) -> OwnModule:
    module = OwnModule(dim)
    trainer = L.Trainer(
        accelerator="auto",
        devices=n_ranks,
        strategy=MeshStrategy(dp=n_ranks, **strategy),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return module


def offload_placement(module: OwnModule) -> dict[str, Any]:
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    policies = [isinstance(m._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy) for m in units]
    optimizer = module.trainer.strategy.optimizers[0]
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]

    def device_bytes(tensors: list[torch.Tensor]) -> int:
        locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in locals_ if t.device.type != "cpu")

    return {
        "units_with_cpu_offload_policy": f"{sum(policies)}/{len(units)}",
        "device_bytes": {
            "parameters": device_bytes(list(module.parameters())),
            "gradients": device_bytes([p.grad for p in module.parameters() if p.grad is not None]),
            "optimizer_state": device_bytes(states),
        },
    }


def offload_against_without(per_block: OwnModule, offloaded: OwnModule) -> dict[str, Any]:
    """cpu_offload's placement; on GPUs, with the device bytes of the same run without it beside."""
    result = offload_placement(offloaded)
    if torch.cuda.is_available():  # on CPU ranks every byte is on the host either way: nothing to compare
        result["device_bytes_without_cpu_offload"] = offload_placement(per_block)["device_bytes"]
    return result


def worker(args: argparse.Namespace) -> None:
    n_ranks = ranks(args)
    per_block = fit(args.dim, n_ranks)  # the 12 blocks found, + the rest
    offloaded = fit(args.dim, n_ranks, cpu_offload=True)
    if args.offload_only:
        C.emit(
            {
                "benchmark": "own_model_memory",
                "config": {"dim": args.dim, "blocks": N_BLOCKS, "dp": n_ranks, "vocab": VOCAB, "offload_only": True},
                "cpu_offload": offload_against_without(per_block, offloaded),
                "environment": C.environment(),
            }
        )
        return
    one_unit = fit(args.dim, auto_wrap_policy=set())  # no module selected: the whole model is one unit
    full = sum(p.numel() * 4 for p in Transformer(args.dim).parameters())
    peaks = {"one_unit": max(C.gather(one_unit.peak)), "per_block": max(C.gather(per_block.peak))}
    C.emit(
        {
            "benchmark": "own_model_memory",
            "config": {"dim": args.dim, "blocks": N_BLOCKS, "dp": N_RANKS, "vocab": VOCAB},
            "full_parameter_bytes": full,
            "peak_parameter_bytes_in_forward": peaks,
            "fraction_of_full": {k: round(v / full, 4) for k, v in peaks.items()},
            "goal_fraction": round(GOAL, 4),
            "per_block_meets_goal": peaks["per_block"] <= GOAL * full,
            "cpu_offload": offload_against_without(per_block, offloaded),
            "environment": C.environment(),
        }
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--offload-only", action="store_true", help="only CPU offload against without (see the doc)")
    return p.parse_args(argv)


if __name__ == "__main__":
    C.run(sys.argv[1:], parse_args, worker, C.launch_once(__file__, ranks), one_thread=True)
