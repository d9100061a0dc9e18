"""Run by torchrun (2 ranks, gloo): an fp16 overflow on one rank only makes every rank skip the step.

DTensor gradients on two meshes (one sharded, one replicated), as MeshStrategy's optimizers see them.
Writes one JSON line per rank to OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lit_mesh.training.precision import MeshGradScaler
from tests.workers import exit_skipping_teardown


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    replicated = torch.nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    optimizer = torch.optim.SGD([sharded, replicated], lr=0.1)
    scaler = MeshGradScaler("cpu", init_scale=8.0, growth_interval=1)
    record = []
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(torch.zeros(()))  # as scaler.scale(loss) would, before backward
        sharded.grad = distribute_tensor(torch.full((4, 2), 8.0), mesh, [Shard(0)])
        replicated.grad = distribute_tensor(torch.full((3,), 8.0), mesh, [Replicate()])
        if step == 1 and rank == 1:  # an overflow in rank 1's shard only
            sharded.grad._local_tensor[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        record.append(
            {
                "sharded": sharded._local_tensor.sum().item(),
                "replicated": replicated._local_tensor.sum().item(),
                "scale": scaler.get_scale(),
            }
        )
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    exit_skipping_teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
