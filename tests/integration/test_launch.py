"""The test launcher (tests/fork_launch.py) against torchrun: the ranks it forks see what torchrun's would (launcher
variables, generators seeded afresh on every rank, thread count, Lightning's cluster environment), and a rank that
fails stops the others instead of leaving the launch to its timeout."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.launch import launch, torchrun


def _seen(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def test_forked_ranks_see_what_torchrun_ranks_see(tmp_path: Path) -> None:
    (tmp_path / "fork").mkdir()
    (tmp_path / "torchrun").mkdir()
    forked = launch(2, "launch_probe.py", str(tmp_path / "fork"), "probe", timeout=120)
    assert forked.returncode == 0, forked.stderr[-3000:]
    reference = torchrun(2, "launch_probe.py", str(tmp_path / "torchrun"), "probe", timeout=120)
    assert reference.returncode == 0, reference.stderr[-3000:]
    for fork, run in zip(_seen(tmp_path / "fork", 2), _seen(tmp_path / "torchrun", 2)):
        assert fork["variables"] == run["variables"]
        assert fork["has_master"] and run["has_master"]
        assert (
            (fork["threads"], fork["environment"])
            == (run["threads"], run["environment"])
            == (1, "TorchElasticEnvironment")
        )
    for launcher in ("fork", "torchrun"):  # torch seeds its generator at random on start: every rank its own seed
        ranks = _seen(tmp_path / launcher, 2)
        assert ranks[0]["torch_rand"] != ranks[1]["torch_rand"], launcher
        assert ranks[0]["python_random"] != ranks[1]["python_random"], launcher


def test_a_failed_rank_stops_the_launch(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = launch(2, "launch_probe.py", str(tmp_path), "fail", timeout=120)
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "exited with 3" in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - started < 60, "the waiting rank was stopped, not left to the timeout"
