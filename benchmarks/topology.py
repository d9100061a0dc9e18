"""Hierarchical vs flat all-reduce across nodes: bytes that cross the node boundary per rank and sequential
inter-node steps, measured on the wire for simulated nodes on this host, next to the formulas; and the alpha-beta
cost model's predicted gradient all-reduce time per step at cluster scale.

Measured: for each simulated (nodes, devices per node), one torchrun launch of nodes x devices ranks on this
host with an explicit `Topology`; the DDP replicate group is all ranks. Each rank all-reduces S bytes (fp32)
flat and hierarchically (lit_mesh.comm.hierarchical), while a dispatch mode (lit_mesh.monitor.comm's
CollectiveBytes, ring model) records every collective's group and bytes: groups whose ranks sit on more than
one node are "cross-node". Steps: ring steps of the cross-node collectives (all-reduce 2(k-1), all-gather and
reduce-scatter k-1). The two results are also checked equal. Formulas: flat ring 2(N-1)/N·S per rank,
hierarchical 2(n-1)/n·S/g.

Predicted (no run): the cost model (lit_mesh.comm.hierarchical, Topology defaults: 450 GB/s NVLink, 50 GB/s per
GPU between nodes, 5/15 us per step) for the fp32 gradients of DDP over every GPU, for the zoo GPT presets.

    python benchmarks/topology.py
    python benchmarks/topology.py --simulate 2x2 2x4 --mib 4
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import _common as C  # noqa: N812 (puts the repo on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lit_mesh.comm import hierarchical  # noqa: E402
from lit_mesh.comm.topology import Topology  # noqa: E402
from lit_mesh.mesh import MeshAxis, MeshLayout, build_device_mesh  # noqa: E402
from lit_mesh.monitor.comm import CollectiveBytes, _group_name  # noqa: E402

_STEPS = {"all_reduce": lambda k: 2 * (k - 1), "gather": lambda k: k - 1, "scatter": lambda k: k - 1}


class CrossNodeCounter(CollectiveBytes):
    """CollectiveBytes that also counts the ring steps of each group's collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, int] = {}

    def _count(self, kind: str, tensor_index: int, group_index: int, args: tuple) -> None:
        super()._count(kind, tensor_index, group_index, args)
        group = _group_name(args[group_index])
        k = dist.get_world_size(dist.distributed_c10d._resolve_process_group(group))
        self.steps[group] = self.steps.get(group, 0) + _STEPS.get(kind, lambda k: 0)(k)


def measure(h: hierarchical.Hierarchy, topology: Topology, numel: int, flat: bool) -> dict[str, Any]:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    counter = CrossNodeCounter()
    with counter:
        if flat:
            dist.all_reduce(x, group=h.group)
        else:
            hierarchical.all_reduce(x, h, average=False)
    names = {_group_name(g): g for g in (h.group, h.intra, h.inter)}
    cross = [n for n in counter.sent if len({topology.node_of(r) for r in dist.get_process_group_ranks(names[n])}) > 1]
    return {
        "result": x,
        "inter_node_bytes": sum(counter.sent[n] for n in cross),
        "intra_node_bytes": sum(v for n, v in counter.sent.items() if n not in cross),
        "inter_node_steps": sum(counter.steps.get(n, 0) for n in cross),
    }


def worker(args: argparse.Namespace) -> None:
    nodes, per_node = map(int, args.layout.split("x"))
    topology = Topology(nodes=nodes, devices_per_node=per_node)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        world = dist.get_world_size()
    assert world == topology.world_size, (world, topology)
    layout = MeshLayout(dp_replicate=world)
    views = build_device_mesh(layout, "cpu")
    group = views.root.get_group(MeshAxis.DP_REPLICATE)
    h = hierarchical.build_hierarchy(
        views.root, (MeshAxis.DP_REPLICATE,), group, topology, "hierarchical", "dp_replicate"
    )
    assert h is not None
    numel = int(args.mib * 2**20) // 4
    size = numel * 4
    flat, hier = measure(h, topology, numel, flat=True), measure(h, topology, numel, flat=False)
    torch.testing.assert_close(hier.pop("result"), flat.pop("result"), rtol=1e-5, atol=1e-5)
    n, g = nodes, per_node
    out = {
        "nodes": n,
        "devices_per_node": g,
        "bytes_per_rank_S": size,
        "flat": {
            **flat,
            "formula_inter_node_bytes": hierarchical.inter_node_bytes(size, n, g, False),
            "formula_inter_node_steps": hierarchical.inter_node_steps(n, g, False),
        },
        "hierarchical": {
            **hier,
            "formula_inter_node_bytes": hierarchical.inter_node_bytes(size, n, g, True),
            "formula_inter_node_steps": hierarchical.inter_node_steps(n, g, True),
        },
        "equal_results": True,
    }
    everyone = C.gather(out)  # every rank sends the same in a ring: check it, report rank 0
    assert all(o == out for o in everyone), everyone
    C.emit(out)


# a layout per preset that fits 80 GB and keeps several replicas on a node (else the hierarchy has g = 1):
# small on DDP over every GPU (8 replicas per node); llama3-8b on HSDP, FSDP over 4 GPUs (2 replicas per node)
STEP_LAYOUTS = {"small": 1, "llama3-8b": 4}  # preset -> dp_shard
STEP_SEQ_LEN = {"small": 512, "llama3-8b": 4096}  # one sequence per GPU per step, bf16-mixed, no AC


def predicted(presets: list[str], clusters: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Per preset and cluster: the gradient all-reduce over the replicas, flat and hierarchical, and the step
    time of the planner's cost model (compute roofline, overlapped and exposed collectives) with either."""
    from lit_mesh.mesh import MeshLayout
    from lit_mesh.planner.cost import step_time
    from lit_mesh.planner.hardware import Hardware
    from lit_mesh.planner.memory import Workload
    from lit_mesh.planner.shapes import gpt_shapes
    from zoo.gpt import GPTConfig

    rows = []
    for preset in presets:
        shapes = gpt_shapes(GPTConfig.from_preset(preset))
        dp_shard = STEP_LAYOUTS.get(preset, 1)
        for n, g in clusters:
            world = n * g
            layout = MeshLayout(dp_replicate=world // dp_shard, dp_shard=dp_shard)
            replicas_per_node = g // dp_shard
            nbytes = 4 * shapes.numel() / dp_shard  # each replica group all-reduces its fp32 gradient shard
            topo = Topology(nodes=n, devices_per_node=g)
            flat = hierarchical.flat_time(nbytes, n, replicas_per_node, topo)
            hier = hierarchical.hierarchical_time(nbytes, n, replicas_per_node, topo)
            work = Workload(global_batch=world, seq_len=STEP_SEQ_LEN.get(preset, 2048))
            t = step_time(shapes, layout, work, "bf16-mixed", "none", Hardware(nodes=n, devices_per_node=g))
            t.overlapped["dp_replicate"] = flat
            flat_step = t.total
            t.overlapped["dp_replicate"] = hier
            hier_step = t.total
            rows.append(
                {
                    "preset": preset,
                    "nodes": n,
                    "devices_per_node": g,
                    "dp_shard": dp_shard,
                    "dp_replicate": layout.dp_replicate,
                    "replicas_per_node": replicas_per_node,
                    "seq_len": work.seq_len,
                    "gradient_bytes": nbytes,
                    "flat_s": round(flat, 6),
                    "hierarchical_s": round(hier, 6),
                    "saved_per_step_s": round(flat - hier, 6),
                    "speedup": round(flat / hier, 2),
                    "compute_s": round(t.compute, 6),
                    "step_flat_s": round(flat_step, 6),
                    "step_hierarchical_s": round(hier_step, 6),
                    "step_speedup": round(flat_step / hier_step, 3),
                }
            )
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", nargs="+", default=["2x2", "2x4"], help="NODESxDEVICES_PER_NODE, run on this host")
    p.add_argument("--layout", default="2x2", help=argparse.SUPPRESS)  # one launch's, set by the launcher
    p.add_argument("--mib", type=float, default=4.0, help="tensor size S per rank (fp32), MiB")
    p.add_argument("--presets", nargs="+", default=["small", "llama3-8b"])
    p.add_argument("--timeout", type=float, default=600)
    return p.parse_args(argv)


def drive(args: argparse.Namespace, argv: list[str]) -> None:
    """The launching process: one launch per simulated NODESxDEVICES layout, then the cost model's figures."""
    measured = []
    for spec in args.simulate:
        nodes, per_node = map(int, spec.split("x"))
        measured.append(
            C.launch(__file__, ["--layout", spec, "--mib", str(args.mib)], nproc=nodes * per_node, timeout=args.timeout)
        )
    C.print_result(
        {
            "measured": measured,
            "predicted_gradient_all_reduce_per_step": predicted(args.presets, [(4, 8), (64, 8)]),
            "environment": C.environment(),
        }
    )


def main(argv: list[str]) -> None:
    C.run(argv, parse_args, worker, drive, one_thread=True)


if __name__ == "__main__":
    main(sys.argv[1:])
