"""Run CLI invocations that must fail after the processes started; record each error (type and message).

Usage: torchrun --standalone --nproc_per_node=N tests/workers/expect_errors.py OUT_JSON CASES_JSON
CASES_JSON is {case name: [cli args]}. Every rank raises the same error before any collective diverges,
so the ranks stay in step and the next case can run in the same processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from lit_mesh.cli import run
from tests.workers import exit_skipping_teardown

if __name__ == "__main__":
    out, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    errors: dict[str, dict[str, str]] = {}
    for name, args in cases.items():
        try:
            run(args)
            errors[name] = {"type": "", "message": "no error"}
        except Exception as error:  # noqa: BLE001 - recorded for the test to judge
            errors[name] = {"type": type(error).__name__, "message": str(error)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.write_text(json.dumps(errors))
    exit_skipping_teardown()
