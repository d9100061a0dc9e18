"""The real plan at the target scale, in one process: lit_mesh's own `parallelize` applied to a meta-device
model on torch's fake process group (no memory, no communication), then the bytes one rank truly holds.

Parameters: the local shards after parallelize (what MeshStrategy.setup builds). Gradients: what FSDP2 and
DTensor give each parameter (a tensor of the parameter's placements and dtype), allocated as zeros_like.
Optimizer: a real AdamW step, then its exp_avg and exp_avg_sq. It steps the rank's local shards: a DTensor
parameter's state is a DTensor of the same local shard, and stepping the shards directly takes a fraction of
the time (DTensor dispatch per op dominates on hundreds of parameters).
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lit_mesh.mesh import MeshLayout, build_device_mesh, resolve_layout
from lit_mesh.options import ExpertOptions, MeshDegrees, MeshOptions
from lit_mesh.parallel.apply import parallelize
from lit_mesh.parallel.pipeline.schedules import PipelineSettings
from lit_mesh.planner.families import family
from lit_mesh.planner.pipeline_model import ONE_F_ONE_B, Schedule
from lit_mesh.planner.shapes import build_model


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def simulate_rank(
    config: Any,
    layout: MeshLayout,
    rank: int = 0,
    precision: str = "bf16-mixed",
    optimizer: bool = True,
    schedule: Schedule = ONE_F_ONE_B,
    expert_tp: int | None = None,
) -> dict[str, Any]:
    """Bytes of parameters, gradients and AdamW state on global rank `rank` of `layout` (fake process group),
    with the pipeline stages of `schedule` (pp > 1) and MeshStrategy's `expert_tp`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulate_rank needs a process without a process group (it creates a fake one)")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        root = nn.Module()  # stands in for the LightningModule, which holds the network as `model`
        with torch.device("meta"):
            root.model = build_model(config)  # e.g. the zoo's GPT or MoETransformer
        if precision == "bf16-true":  # Lightning's precision plugin casts the meta model before setup
            root.to(torch.bfloat16)
        pipeline = PipelineSettings(schedule.name, stages_per_rank=schedule.stages_per_rank)
        options = MeshOptions(
            mesh=MeshDegrees(sequence_parallel=layout.tp > 1), pipeline=pipeline, expert=ExpertOptions(expert_tp)
        )
        parallelize(root, build_device_mesh(layout, "cpu"), options, precision=precision)
        params = list(root.parameters())
        out: dict[str, Any] = {"params": sum(_local_bytes(p) for p in params)}
        if optimizer:
            for p in params:
                p.grad = torch.zeros_like(p)
            grads = [cast(torch.Tensor, p.grad) for p in params]  # set just above
            out["grads"] = sum(_local_bytes(g) for g in grads)
            shards = [(p.to_local() if hasattr(p, "to_local") else p).detach().requires_grad_() for p in params]
            for shard, g in zip(shards, grads):
                shard.grad = g.to_local() if hasattr(g, "to_local") else g
            adamw = torch.optim.AdamW(shards, foreach=True)
            adamw.step()
            out["optimizer"] = sum(_local_bytes(s[k]) for s in adamw.state.values() for k in ("exp_avg", "exp_avg_sq"))
    finally:
        dist.destroy_process_group()
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def fake_rank_params(preset: str, n: int, model_family: str = "gpt") -> dict[str, Any]:
    """Rank 0's parameter bytes for the family's `preset` under FSDP over n fake ranks, against the ideal total / n."""
    config = family(model_family).config(preset)
    layout = resolve_layout(n, dp=n)
    with torch.device("meta"):
        total = sum(p.numel() * p.element_size() for p in build_model(config).parameters())
    rank0 = simulate_rank(config, layout, 0, precision="32-true", optimizer=False)["params"]
    ideal = total / n
    return {
        "preset": preset,
        "fsdp": n,
        "layout": layout.describe(),
        "single_device_param_bytes": total,
        "rank0_param_bytes": rank0,
        "ideal_param_bytes": ideal,
        "ratio": round(rank0 / ideal, 4),
        "note": "fake process group + meta tensors; grads and AdamW state share the parameters' sharding",
    }
