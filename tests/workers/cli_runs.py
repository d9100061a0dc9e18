"""Run several `lit-mesh` CLI invocations, one after another, in the processes torchrun started.

Usage (from tests): torchrun --standalone --nproc_per_node=N tests/workers/cli_runs.py OUT_DIR RUNS_JSON
RUNS_JSON is a list of {"name": str, "args": [cli args], "command": "fit" (default) or another subcommand}; a
restarted launch skips the runs already finished. For each fit, rank 0 writes OUT_DIR/NAME/result.json with the
logged metrics per step and OUT_DIR/NAME/params.pt with the final full (unsharded) parameters; other commands write
result.json with the world size and logged metrics (predictions: add the SavePredictions callback).
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lit_mesh.cli import run as run_cli
from tests.workers import exit_skipping_teardown


def metrics_by_step(save_dir: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} from the CSVLogger files under save_dir."""
    found: dict[str, dict[int, float]] = {}
    for path in sorted(save_dir.rglob("metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if key not in ("epoch", "step") and value not in ("", None):
                        found.setdefault(key, {})[int(row["step"])] = float(value)
    return found


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's unsharded parameters (pipeline stages' parts merged); complete on rank 0."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        local = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        local = {name: t.detach().cpu() for name, t in local.items()}
    else:
        local = {name: p.detach().cpu().clone() for name, p in model.state_dict().items()}
    if not dist.is_initialized():
        return local
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)  # tiny test models: pipeline stages hold different parameters
    return {name: t for part in parts for name, t in part.items()}


class SavePredictions(BasePredictionWriter):
    """Writes each rank's inputs and predictions per batch to OUTPUT_DIR/rank{R}-batch{B}.pt."""

    def __init__(self, output_dir: str) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)

    @override
    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):  # noqa: ANN001
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = {"inputs": batch[0].cpu(), "predictions": prediction.detach().cpu()}
        torch.save(record, self.output_dir / f"rank{trainer.global_rank}-batch{batch_idx}.pt")


def run(out_dir: Path, name: str, args: list[str], command: str = "fit") -> None:
    save_dir = out_dir / name
    start = time.perf_counter()
    cli = run_cli([command, *args, f"--trainer.logger.save_dir={save_dir}"])
    assert cli is not None
    if command != "fit":
        if cli.trainer.global_rank == 0:
            result = {"world_size": cli.trainer.world_size, "metrics": metrics_by_step(save_dir)}
            (save_dir / "result.json").write_text(json.dumps(result))
        return
    params = full_parameters(cli.model)
    if cli.trainer.global_rank == 0:
        torch.save(params, save_dir / "params.pt")
        result = {
            "metrics": metrics_by_step(save_dir),
            "world_size": cli.trainer.world_size,
            "progress_bar": {k: float(v) for k, v in cli.trainer.progress_bar_metrics.items()},  # the last step's
            "seconds": round(time.perf_counter() - start, 2),  # what the run cost the suite (to keep it short)
        }
        (save_dir / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for spec in runs:
        if (out / spec["name"] / "result.json").is_file():
            continue  # finished in an earlier attempt of this launch (torchrun --max-restarts)
        run(out, spec["name"], spec["args"], spec.get("command", "fit"))
    exit_skipping_teardown()
