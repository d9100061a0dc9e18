"""Run everything one launch of tests/test_hf.py needs, in the processes torchrun started (imports paid once).

Usage: torchrun --standalone --nproc_per_node=N tests/workers/hf_runs.py OUT_DIR RUNS_JSON
RUNS_JSON is a list of {"kind": "fit" | "error" | "example", "name": str, "args": [...]}:
- fit: a `lit-mesh fit` run (see cli_runs.py): OUT_DIR/NAME/result.json and params.pt;
- error: a `lit-mesh fit` run that must fail: its error goes to OUT_DIR/errors_N.json (see expect_errors.py);
- example: examples/SCRIPT's main(args + ["--out", OUT_DIR/NAME.json]), args[0] being the script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from lit_mesh.cli import close_process_groups
from lit_mesh.cli import run as run_cli
from tests.workers.cli_runs import run as run_fit
from tests.workers.examples_runs import load

if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    errors: dict[str, dict[str, str]] = {}
    for spec in runs:
        if spec["kind"] == "fit":
            run_fit(out, spec["name"], spec["args"])
        elif spec["kind"] == "example":
            script, *args = spec["args"]
            load(script).main([*args, "--out", str(out / f"{spec['name']}.json")])
        else:
            try:
                run_cli(["fit", *spec["args"]])
                errors[spec["name"]] = {"type": "", "message": "no error"}
            except Exception as error:  # noqa: BLE001 - recorded for the test to judge
                errors[spec["name"]] = {"type": type(error).__name__, "message": str(error)}
    if errors and (not dist.is_initialized() or dist.get_rank() == 0):
        world = dist.get_world_size() if dist.is_initialized() else 1
        (out / f"errors_{world}.json").write_text(json.dumps(errors))
    close_process_groups()
