"""Start-up at scale: the time to materialise and initialise a zoo model as one rank of an FSDP layout, in one
process on torch's fake process group (nothing is communicated; the rank allocates and fills only its shards).

It times lit_mesh.init.materialize, what MeshStrategy.setup runs after parallelize: allocate the meta model's local
shards on the device, then draw every parameter by the plan's init rules (layout-independent: each parameter from
its own generator, seeded by the run's seed and the parameter's name) and keep this rank's shard.

    python benchmarks/startup.py                                  # llama3-8b, rank 0 of fsdp8, on the CPU
    python benchmarks/startup.py --preset small --world 2 --rank 1
    python benchmarks/startup.py --device cuda                    # where a GPU is

Prints one JSON line: preset, world, rank, device, parameters (whole model), local parameters, seconds and
cpu_seconds (materialise + init: wall time, and this process's CPU time).
"""

from __future__ import annotations

import json
import time
from argparse import ArgumentParser

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--world", type=int, default=8, help="FSDP degree (fake ranks)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit_mesh.init import materialize
    from lit_mesh.mesh import MeshLayout, build_device_mesh
    from lit_mesh.options import MeshDegrees, MeshOptions
    from lit_mesh.parallel.apply import parallelize
    from zoo.gpt import GPT, PRESETS

    torch.manual_seed(args.seed)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    try:
        root = nn.Module()
        with torch.device("meta"):
            root.model = GPT(PRESETS[args.preset])
        total = sum(p.numel() for p in root.model.parameters())
        views = build_device_mesh(MeshLayout(dp_shard=args.world), args.device)
        done = parallelize(root, views, MeshOptions(mesh=MeshDegrees()), precision="32-true")
        device = torch.device(args.device)
        start, cpu_start = time.perf_counter(), time.process_time()
        materialize(root.model, done.owners, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in root.model.parameters())
    finally:
        dist.destroy_process_group()
    result = {
        "benchmark": "startup",
        "preset": args.preset,
        "world": args.world,
        "rank": args.rank,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
        "parameters": total,
        "local_parameters": local,
        "seconds": round(seconds, 2),
        "cpu_seconds": round(cpu_seconds, 2),  # this process's CPU time: steadier than wall time on a shared host
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
