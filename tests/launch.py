"""Launch multi-process workers with a timeout, so a hang fails fast instead of stalling the suite."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
# what a launcher sets per rank: in-process tests can leave them in os.environ, never to reach a launch's ranks
LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


FORK_LAUNCH = [sys.executable, str(REPO / "tests" / "fork_launch.py")]
LAUNCHERS = ("fork", "torchrun")  # LIT_MESH_TEST_LAUNCHER


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default range


def free_port() -> int:
    """A port for rank 0's store that nothing else on this machine will take before rank 0 binds it.

    Not one the kernel hands out (port 0): those come from the ephemeral range, which every gloo pair socket and
    client connection of the other pytest-xdist worker draws from too, so in the seconds before rank 0 binds it
    one of them took it (EADDRINUSE in CI). Below that range the kernel assigns nothing by itself, and each xdist
    worker picks in a band of its own, so the only other holders are explicit binds, which the bind here detects.
    """
    low, high = _ephemeral_ports()
    first, last = (10000, low - 1) if low > 12000 else (high + 1, 65535)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) % workers if worker[2:].isdigit() else 0
    band = (last - first + 1) // workers
    first += index * band
    draw = random.SystemRandom()  # not the tests' seeded generator: two launches in a row must not repeat a port
    for _ in range(200):
        port = draw.randrange(first, first + band)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port in TIME_WAIT fails here too
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + band - 1} after 200 tries")


def run_command(cmd: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    # PYTHONPATH: workers and CLI configs may name test helpers (tests.workers.*) as class paths
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}  # a rank of nothing here
    env = {**inherited, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    # a scratch working directory: Lightning writes logs and config.yaml there, never into the repository
    workdir = cwd or tempfile.mkdtemp(prefix="lit-mesh-test-")
    # a session of its own: on a timeout the whole process group goes (the ranks too, not their launcher alone)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, env=env, start_new_session=True
    )
    started = time.monotonic()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        _log_launch(cmd, time.monotonic() - started)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{stdout[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _log_launch(cmd: list[str], seconds: float) -> None:
    """With LIT_MESH_LAUNCH_LOG=FILE, one JSON line per launch (test, command, wall seconds): where suite time goes."""
    path = os.environ.get("LIT_MESH_LAUNCH_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(path, "a") as f:
            f.write(
                json.dumps({"test": test, "cmd": [Path(c).name for c in cmd[:8]], "seconds": round(seconds, 1)}) + "\n"
            )


def torchrun(
    nproc: int, script: str, *args: str, timeout: float = 300, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
    ]
    return run_command([*cmd, str(WORKERS / script), *args], timeout)


def launch(nproc: int, script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a worker on nproc ranks forked from one interpreter (tests/fork_launch.py: the imports paid once);
    LIT_MESH_TEST_LAUNCHER=torchrun runs every such launch under torchrun instead."""
    launcher = os.environ.get("LIT_MESH_TEST_LAUNCHER", "fork")
    if launcher not in LAUNCHERS:
        raise ValueError(f"LIT_MESH_TEST_LAUNCHER={launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if launcher == "torchrun":
        return torchrun(nproc, script, *args, timeout=timeout)
    return run_command([*FORK_LAUNCH, str(nproc), str(WORKERS / script), *args], timeout)


def launch_with_environments(
    environments: list[dict[str, str]], script: Path, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run `script` once per environment (a whole one each: e.g. what srun sets per task), the ranks forked from one
    interpreter as in `launch`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(environments, f)
        f.flush()
        return run_command([*FORK_LAUNCH, "--rank-environments", f.name, str(script), *args], timeout)


def cli_runs(nproc: int, out_dir: Path, runs: list[dict], timeout: float = 600) -> dict[str, dict]:
    """Run lit-mesh CLI invocations in one launch of nproc ranks; returns {name: result} (see workers/cli_runs.py)."""
    spec = out_dir / f"runs_{nproc}.json"
    spec.write_text(json.dumps(runs))
    proc = launch(nproc, "cli_runs.py", str(out_dir), str(spec), timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"cli_runs with {nproc} processes failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return {r["name"]: json.loads((out_dir / r["name"] / "result.json").read_text()) for r in runs}
