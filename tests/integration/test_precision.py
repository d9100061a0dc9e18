"""fp16 mixed precision: the loss scaler agrees over every rank on when to skip a step."""

from __future__ import annotations

import json
from pathlib import Path

from tests.launch import launch


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    proc = launch(2, "scaler_agreement.py", str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # step 0 updates (grad 8 / scale 8 = 1, lr 0.1) and doubles the scale (growth_interval=1); step 1
    # overflows on rank 1 only: both ranks skip it and halve the scale to 8; step 2 updates (8 / 8 = 1)
    for record in (rank0, rank1):
        assert [r["scale"] for r in record] == [16.0, 8.0, 16.0]
        assert [round(r["sharded"], 5) for r in record] == [3.6, 3.6, 3.2]  # 4 local elements each
        assert [round(r["replicated"], 5) for r in record] == [2.7, 2.7, 2.4]
