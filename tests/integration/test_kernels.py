"""Loss parallel across ranks: the logits stay sharded over the vocabulary into the loss (the in-process kernel
checks are in tests/unit/test_kernels.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.launch import launch


def test_loss_parallel_keeps_the_logits_sharded_over_the_vocabulary(tmp_path: Path) -> None:
    out = tmp_path / "loss_parallel.json"
    proc = launch(2, "loss_parallel.py", str(out), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["sharded_over_vocab"], result["placements"]
    assert result["local_shape"] == [2, 16, 128]  # vocab 256 over tp=2
    assert set(result["collectives_in_loss"]) == {"allreduce_.default"}, result["collectives_in_loss"]
    assert result["loss_error"] <= 1e-6 and result["grad_error"] <= 1e-6, result
