"""Run benchmark scripts, each as `python benchmarks/NAME.py ARGS` would, in children forked from this one
interpreter that has imported torch, Lightning, lit-mesh and the zoo once (tests/integration/test_benchmarks_smoke.py).

Usage: python tests/workers/benchmark_smoke.py OUT SPEC   (SPEC: a JSON list of {"name", "script", "argv"})

Each script's stdout and stderr go to OUT/NAME.stdout and OUT/NAME.stderr, its exit code and wall seconds to
OUT/NAME.json. The scripts' own launches fork their ranks from the script's process too
(LIT_MESH_BENCH_LAUNCHER=fork, benchmarks/_common.py): a torchrun rank is a fresh interpreter that pays ~5 s of CPU
importing, more than a smoke-sized run trains. Every process runs one intra-op thread (OMP_NUM_THREADS=1, set
before torch is imported): forking a process whose OpenMP pool has started is unsafe, and the runs are tiny.
Two scripts run at a time: most of a smoke-sized run is Python overhead on one core.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tests.launch import WORKERS

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported (see the docstring)
os.environ["LIT_MESH_BENCH_LAUNCHER"] = "fork"
PARALLEL = 2


def _run_script(out: Path, name: str, script: str, argv: list[str]) -> None:
    """The forked child: the script as __main__ with its output in files; never returns."""
    code = 1
    try:
        for fd, suffix in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(out / f"{name}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [script, *argv]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception, then the child exits 1
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _forked_test_launch(nproc: int, script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """tests/launch.py `launch` (the CLI runs of host_sync.py and loss_curves.py) with the ranks forked from this
    process rather than from a fresh fork_launch.py interpreter; their output is in the script's stderr."""
    from benchmarks._common import fork_ranks

    code = fork_ranks(str(WORKERS / script), args, nproc, {**os.environ, "PYTHONWARNINGS": "ignore"})
    return subprocess.CompletedProcess([script, *args], code, "", "(the ranks' output is above, in this stderr)")


def main() -> None:
    out, spec = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    # what the scripts import: loaded once here, before any thread or process group exists (safe to fork)
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    import lit_mesh.cli  # noqa: F401
    import tests.launch
    import zoo  # noqa: F401

    tests.launch.launch = _forked_test_launch  # cli_runs looks `launch` up at each call

    pending, running = list(spec), {}
    while pending or running:
        while pending and len(running) < PARALLEL:
            run = pending.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_script(out, run["name"], run["script"], run["argv"])
            running[pid] = (run["name"], time.monotonic())
        pid, status = os.wait()
        if pid in running:
            name, started = running.pop(pid)
            seconds = round(time.monotonic() - started, 1)
            code = os.waitstatus_to_exitcode(status)
            (out / f"{name}.json").write_text(json.dumps({"returncode": code, "seconds": seconds}))
            print(f"{name}: exit {code} in {seconds} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
