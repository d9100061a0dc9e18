"""CLI fits in the processes of a multi-node launch (torchrun --nnodes 2 on one host, or simulated SLURM tasks),
recording per run what MeshStrategy made of the topology as well as the logged metrics.

Usage: WORKER OUT_DIR RUNS_JSON (as tests/workers/cli_runs.py); rank 0 also writes OUT_DIR/NAME/strategy.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch.distributed as dist

from lit_mesh.cli import run as run_cli
from tests.workers import exit_skipping_teardown
from tests.workers.cli_runs import full_parameters, metrics_by_step


def node_sets(group, topology) -> list[int]:
    return sorted({topology.node_of(r) for r in dist.get_process_group_ranks(group)})


def run(out_dir: Path, name: str, args: list[str]) -> None:
    save_dir = out_dir / name
    cli = run_cli(["fit", *args, f"--trainer.logger.save_dir={save_dir}"])
    assert cli is not None
    strategy = cli.trainer.strategy
    topo, views, env = strategy.topology, strategy.mesh_views, strategy.cluster_environment
    facts = {
        "environment": type(env).__name__,
        "topology": asdict(topo),
        "rank": [env.global_rank(), env.node_rank(), env.local_rank()],
        "tp_nodes": node_sets(views.root.get_group("tp"), topo),
        # the MoE layers' dispatchers (ep_dispatch="by_node": ByNodeDispatch where an ep group spans nodes)
        "dispatchers": sorted({type(m.dispatcher).__name__ for m in cli.model.modules() if hasattr(m, "dispatcher")}),
        "hierarchies": {
            h.axis: {"intra": dist.get_process_group_ranks(h.intra), "inter": dist.get_process_group_ranks(h.inter)}
            for h in strategy.reductions.hierarchies()
        },
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, facts)
    params = full_parameters(cli.model)
    if cli.trainer.global_rank == 0:
        import torch

        torch.save(params, save_dir / "params.pt")
        (save_dir / "result.json").write_text(json.dumps({"metrics": metrics_by_step(save_dir), "ranks": every}))


if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for spec in runs:
        run(out, spec["name"], spec["args"])
    exit_skipping_teardown()
