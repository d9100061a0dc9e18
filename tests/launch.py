"""Launch multi-process workers with a timeout, so a hang fails fast instead of stalling the suite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"


def run_command(cmd: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    # PYTHONPATH: workers and CLI configs may name test helpers (tests.workers.*) as class paths
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    # a scratch working directory: Lightning writes logs and config.yaml there, never into the repository
    workdir = cwd or tempfile.mkdtemp(prefix="lit-mesh-test-")
    # a session of its own: on a timeout the whole process group goes (torchrun's workers too, not torchrun alone)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{stdout[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def torchrun(nproc: int, script: str, *args: str, timeout: float = 300, max_restarts: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}"]
    return run_command([*cmd, str(WORKERS / script), *args], timeout)


def cli_runs(nproc: int, out_dir: Path, runs: list[dict], timeout: float = 600) -> dict[str, dict]:
    """Run lit-mesh CLI invocations in one torchrun launch; returns {name: result} (see workers/cli_runs.py)."""
    spec = out_dir / f"runs_{nproc}.json"
    spec.write_text(json.dumps(runs))
    proc = torchrun(nproc, "cli_runs.py", str(out_dir), str(spec), timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"cli_runs with {nproc} processes failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return {r["name"]: json.loads((out_dir / r["name"] / "result.json").read_text()) for r in runs}
