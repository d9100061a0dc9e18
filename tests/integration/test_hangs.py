"""Hangs are named (issue #25, item 5): rank 1 of 2 hangs before step 2 (lit_mesh.FaultInjector("hang")) with a
short strategy timeout on gloo; both ranks end with an error naming the mesh dim, the operation and the rank
that did not arrive, within timeout + 30 s of the hang. One torchrun launch of the `lit-mesh` command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

from tests.launch import REPO

TIMEOUT_S = 30  # short, yet longer than the ranks' start-up skew on a loaded machine (it bounds the rendezvous too)
S = "--trainer.strategy.init_args."


def test_a_rank_hung_before_a_collective_is_named_on_every_rank() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "lit_mesh.cli",
        "fit",
        "-c",
        str(REPO / "configs/gpt.yaml"),
        "--trainer.devices=2",
        "--trainer.max_steps=4",
        f"{S}dp=2",
        f"{S}timeout=0:00:{TIMEOUT_S}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks=lit_mesh.FaultInjector",
        "--trainer.callbacks.fault=hang",
        "--trainer.callbacks.step=2",
        "--trainer.callbacks.rank=1",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tempfile.mkdtemp(prefix="lit-mesh-test-"),
    )
    lines, hung_at = [], None
    deadline = time.monotonic() + 600
    assert proc.stdout is not None
    for line in proc.stdout:  # timestamps as the lines arrive: when the hang began, when the launch ended
        lines.append(line)
        if "FaultInjector: hanging before step 2" in line:
            hung_at = time.monotonic()
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the launch did not end within 600 s:\n" + "".join(lines[-40:]))
    proc.wait()
    ended_at, output = time.monotonic(), "".join(lines)
    assert hung_at is not None, output[-4000:]
    assert proc.returncode != 0, output[-4000:]
    assert ended_at - hung_at <= TIMEOUT_S + 30, f"{ended_at - hung_at:.0f} s after the hang\n{output[-4000:]}"
    named = r"collective (\w+) \(#\d+\) on mesh dim '([\w /]+)' \(ranks \[0, 1\]\) did not complete within the timeout of 30 s: ranks that did not arrive: 1 \(started \d+ on it\); ranks \[0\] waited in it"
    rank0 = re.search(r"lit-mesh: CollectiveHangError: " + named, output)  # rank 0: torch's timeout error, named
    rank1 = re.search(r"\[rank 1\] CollectiveHangError: " + named, output)  # rank 1, stuck outside torch: its watch
    assert rank0 and rank1, output[-6000:]
    assert rank0.groups() == rank1.groups(), "one report for the run"
    assert "dp_shard" in rank0[2], rank0[0]  # FSDP's all-gather over dp_shard (x cp) is where rank 0 waits
