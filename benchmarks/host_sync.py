"""Host reads and collectives of a training step that logs nothing, per mesh layout (the CPU stand-in for GPU
stream syncs and collective launches).

Runs the layouts of tests/workers/step_audits.py (fsdp2, fsdp2 with clipping, ddp2 plain and with 1-bit and
PowerSGD compression, pp2 1F1B, cp2, the zoo MoE on ep2, fsdp2 x tp2; 4 steps of the tiny presets through the
`lit-mesh` CLI, log_every_n_steps=2) and reports what lit_mesh.monitor.step_audit.StepAudit counted on step 2 (it
logs nothing), per rank: host syncs (lit_mesh/monitor/host_syncs.py; the optimizer's step counters excluded), the
declared MoE split-size reads, collectives by op and group size.

    python benchmarks/host_sync.py
    python benchmarks/host_sync.py --layouts fsdp2 pp2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)

from tests.workers.step_audits import LAYOUTS, run_audits  # noqa: E402 (importable once _common has put the repo on sys.path)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        audits = run_audits(Path(tmp), args.layouts)
    layouts = {}
    for name, audit in audits.items():
        ranks = audit["ranks"]
        layouts[name] = {
            "args": LAYOUTS[name][2],
            "world_size": audit["world_size"],
            "moe_layers": audit["moe_layers"],
            "host_syncs_max_over_ranks": max(r["host_syncs"] for r in ranks),
            "token_count_copies_max_over_ranks": max(r["token_count_copies"] for r in ranks),
            "same_on_every_rank": all(r == ranks[0] for r in ranks),
            "rank0": ranks[0],
        }
    C.print_result(
        {
            "benchmark": "host_sync",
            "audited_step": 2,
            "log_every_n_steps": 2,
            "layouts": layouts,
            "goal": "0 host syncs and 0 barriers on a step that logs nothing, every layout",
            "goal_met": all(
                v["host_syncs_max_over_ranks"] == 0
                and not any(op.startswith("barrier") for op in v["rank0"]["collectives"])
                for v in layouts.values()
            ),
            "config": {"presets": "tiny (gpt.yaml, moe.yaml)", **C.environment()},
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
