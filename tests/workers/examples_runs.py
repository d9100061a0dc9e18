"""Run several examples/ scripts, one after another, in the processes of one launch (imports paid once).

Usage (from tests/integration/test_examples.py):
    python tests/workers/examples_runs.py OUT_DIR RUNS_JSON                                   # one process
    torchrun --standalone --nproc_per_node=N tests/workers/examples_runs.py OUT_DIR RUNS_JSON  # N processes
RUNS_JSON is a list of {"name": str, "script": "own_model.py", "args": [script flags]}. Each run calls the
script's main(args + ["--out", OUT_DIR/NAME.json]); rank 0 writes the per-step losses there.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tests.workers import exit_skipping_teardown

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))  # as `python examples/x.py` does: the scripts import their shared `_common`


def load(script: str):
    name = f"examples_{Path(script).stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for run in runs:
        load(run["script"]).main([*run["args"], "--out", str(out / f"{run['name']}.json")])
    exit_skipping_teardown()
