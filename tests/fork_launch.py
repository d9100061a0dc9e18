"""Start N ranks of a test worker by forking one interpreter that has already imported torch, Lightning and lit-mesh.

Usage: python tests/fork_launch.py NPROC SCRIPT [ARGS...]   (tests call it through tests/launch.py `launch`)
       python tests/fork_launch.py --rank-environments FILE SCRIPT [ARGS...]   (FILE: a JSON list, one whole
       environment per rank, e.g. the variables srun sets; see `launch_with_environments`)

Why not torchrun for every test: each torchrun rank is a fresh interpreter that imports torch, Lightning and
torchmetrics (which imports transformers, scipy and matplotlib when they are installed: our extras), ~5 s of CPU
per rank; on a 2-core machine a 4-rank launch spends more time importing than training its tiny model. Forked ranks
share the parent's imports. Each rank gets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, ...,
TORCHELASTIC_RUN_ID), so Lightning and lit-mesh read them as under torchrun, and random generators seeded afresh as in
a new interpreter. Tests of torchrun itself (restarts, multi-node rendezvous, the documented commands) still use it.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

from tests.launch import free_port  # PYTHONPATH is the repository (tests/launch.py run_command)


def _torchrun_environment(nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone gives each worker, less the rank (see torch/distributed/elastic/agent)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(nproc),
        "TORCHELASTIC_RUN_ID": f"fork-{os.getpid()}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def _run_rank(environment: dict[str, str], script: str, args: list[str]) -> None:
    """The forked child: take the rank's environment and run the script as __main__; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(environment)
        import random

        import numpy
        import torch

        torch.seed()  # as in a fresh interpreter (torch seeds its generator at random on start): not the parent's
        if "OMP_NUM_THREADS" in environment:  # the rank's own value (OpenMP read the parent's at torch import)
            torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
        random.seed()
        numpy.random.seed()
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception, then the rank exits 1
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait(children: dict[int, int]) -> int:
    """Wait for every rank; on the first failure stop the others (as torchrun does) and return 1."""
    while children:
        pid, status = os.wait()
        rank = children.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(
                f"fork_launch: rank {rank} (pid {pid}) exited with {code}; stopping the other ranks",
                file=sys.stderr,
                flush=True,
            )
            for other in children:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while children and time.monotonic() < deadline:
                done, _ = os.waitpid(-1, os.WNOHANG)
                if done:
                    children.pop(done, None)
                else:
                    time.sleep(0.1)
            for other in children:
                os.kill(other, signal.SIGKILL)
            return 1
    return 0


def main() -> None:
    if sys.argv[1] == "--rank-environments":
        with open(sys.argv[2]) as f:
            environments = json.load(f)
        script, args = sys.argv[3], sys.argv[4:]
        if "OMP_NUM_THREADS" in environments[0]:
            os.environ["OMP_NUM_THREADS"] = environments[0]["OMP_NUM_THREADS"]  # read at torch import
    else:
        nproc, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
        if nproc > 1:
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several workers
        shared = {**os.environ, **_torchrun_environment(nproc, free_port())}
        environments = [{**shared, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)]
    # what the workers import: loaded once here, before any thread or process group exists (safe to fork)
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    import lit_mesh.cli  # noqa: F401
    import zoo  # noqa: F401

    children = {}
    for rank, environment in enumerate(environments):
        pid = os.fork()
        if pid == 0:
            _run_rank(environment, script, args)
        children[pid] = rank
    sys.exit(_wait(children))


if __name__ == "__main__":
    main()
