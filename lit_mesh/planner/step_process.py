"""One fake step (lit_mesh.planner.fake_step) in a Python process of its own.

`lit-mesh plan --simulate` steps rank 0 in its own process, then one rank of every other pp stage that can be the
worst, each here: one process cannot step two fake worlds of the same layout (DTensor keeps state across worlds that
hands the second world the first one's process groups). The model config travels as its dataclass fields (JSON),
the counts come back as one JSON line.

Usage: python -m lit_mesh.planner.step_process SPEC_JSON
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from typing import Any

from lit_mesh.mesh import MeshLayout
from lit_mesh.parallel.expert_by_node import EPDispatch
from lit_mesh.planner.fake_step import StepCounts
from lit_mesh.planner.pipeline_model import Schedule

CONFIG_MODULES = ("zoo.",)  # the config classes a spec may name: the zoo's model configs


def step_in_process(
    config: Any,
    layout: MeshLayout,
    micro_batch: int,
    seq_len: int,
    rank: int,
    precision: str,
    ac: str,
    *,
    zero_stage: int,
    schedule: Schedule,
    microbatches: int,
    float8: str | None = None,
    expert_tp: int | None = None,
    ep_dispatch: EPDispatch = "all_to_all",
    devices_per_node: int = 8,
    timeout: float = 600,
) -> StepCounts:
    """fake_step(...) of `rank`, run in a new Python process; raises RuntimeError with its stderr if it fails."""
    cls = type(config)
    spec = {
        "config_class": f"{cls.__module__}:{cls.__qualname__}",
        "config": dataclasses.asdict(config),
        "layout": dataclasses.asdict(layout),
        "step": {
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            "rank": rank,
            "precision": precision,
            "ac": ac,
            "zero_stage": zero_stage,
            "microbatches": microbatches,
            "float8": float8,
            "expert_tp": expert_tp,
            "ep_dispatch": ep_dispatch,
            "devices_per_node": devices_per_node,
        },
        "schedule": dataclasses.asdict(schedule),
    }
    done = subprocess.run(
        [sys.executable, "-m", "lit_mesh.planner.step_process", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the fake step of rank {rank} failed in its process:\n{done.stderr[-3000:]}")
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    return StepCounts(**counts)


def _config(spec: dict[str, Any]) -> Any:
    module, _, name = spec["config_class"].partition(":")
    if not module.startswith(CONFIG_MODULES):
        raise ValueError(f"config class {spec['config_class']!r}: a step process builds the zoo's configs only")
    cls = getattr(importlib.import_module(module), name)
    return cls(**spec["config"])


def main(argv: list[str]) -> None:
    from lit_mesh.planner.fake_step import fake_step

    spec = json.loads(argv[0])
    counts = fake_step(
        _config(spec),
        MeshLayout(**spec["layout"]),
        schedule=Schedule(**spec["schedule"]),
        **spec["step"],
    )
    print(json.dumps(dataclasses.asdict(counts)))


if __name__ == "__main__":
    main(sys.argv[1:])
