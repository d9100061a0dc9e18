"""`import lit_mesh` and `lit-mesh plan --help` stay free of torch and Lightning (the help answers at once), and
`import lit_mesh` still makes `Trainer(strategy="mesh")` work when Lightning is imported afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: lit_mesh imports without an install

SCRIPT = """
import contextlib, io, sys
import lit_mesh
from lit_mesh.cli import run
with contextlib.redirect_stdout(io.StringIO()) as help_text, contextlib.suppress(SystemExit):
    run(["plan", "--help"])
assert "--seq-len" in help_text.getvalue()
heavy = sorted(m for m in ("torch", "lightning", "zoo", "yaml") if m in sys.modules)
assert not heavy, f"plan --help imported {heavy}"
from lightning.pytorch import Trainer
trainer = Trainer(accelerator="cpu", devices=1, strategy="mesh", logger=False, enable_progress_bar=False)
assert type(trainer.strategy).__name__ == "MeshStrategy", trainer.strategy
assert lit_mesh.MeshStrategy is type(trainer.strategy)
print("ok")
"""


def test_plan_help_imports_no_torch_and_mesh_is_registered_after_lightning_loads() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
