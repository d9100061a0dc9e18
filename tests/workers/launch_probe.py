"""What a rank sees at start (tests/integration/test_launch.py): its launcher variables, the first draws of its random
generators, its thread count and the cluster environment Lightning detects; with `fail`, rank 1 exits 3 while the
others wait forever (the launcher must stop them)."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from tests.workers import exit_skipping_teardown

VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "OMP_NUM_THREADS",
)

if __name__ == "__main__":
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode == "fail":
        if rank == 1:
            sys.exit(3)
        time.sleep(600)
    seen = {
        "variables": {name: os.environ.get(name) for name in VARIABLES},
        "has_master": bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")),
        "torch_rand": torch.rand(3).tolist(),
        "threads": torch.get_num_threads(),
        "environment": next(e.__name__ for e in (TorchElasticEnvironment, LightningEnvironment) if e.detect()),
        "python_random": random.random(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    exit_skipping_teardown()
