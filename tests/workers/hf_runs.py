"""Run everything one launch of tests/integration/test_hf.py needs, in the processes torchrun started (imports paid once).

Usage: torchrun --standalone --nproc_per_node=N tests/workers/hf_runs.py OUT_DIR RUNS_JSON
RUNS_JSON is a list of {"kind": "fit" | "error" | "example", "name": str, "args": [...]}:
- fit: a `lit-mesh fit` run (see cli_runs.py; `--ckpt_path=@NAME` resumes from run NAME's last checkpoint): OUT_DIR/NAME/result.json and params.pt, and layout.json: how the
  mesh was really applied (RecordLayout), so that a run that silently stayed replicated cannot pass;
- error: a `lit-mesh fit` run that must fail: its error goes to OUT_DIR/errors_N.json (see expect_errors.py);
- example: examples/SCRIPT's main(args + ["--out", OUT_DIR/NAME.json]), args[0] being the script;
- predict: a `lit-mesh predict` run (with SavePredictions and RecordReads for a pretrained load).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lit_mesh.checkpoint.pretrained import FileTensor, _runs
from lit_mesh.cli import run as run_cli
from tests.workers import exit_skipping_teardown
from tests.workers.cli_runs import run as run_fit
from tests.workers.examples_runs import load

RECORD_LAYOUT = "--trainer.callbacks+=tests.workers.hf_runs.RecordLayout"


class RecordLayout(L.Callback):
    """Rank 0 writes LOG_DIR/layout.json once training ends: see `layout`."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:  # after the last step FSDP2 has resharded every unit, the root included
            (Path(trainer.logger.save_dir) / "layout.json").write_text(json.dumps(layout(pl_module)))


class RecordReads(L.Callback):
    """Each rank writes OUTPUT_DIR/reads-rank{R}.json: every safetensors tensor it read while the strategy
    loaded the pretrained weights, {key: {"shape": file shape, "reads": [[[start, stop) runs] per dim], ...]}}."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = Path(output_dir)
        self.reads: dict[str, dict[str, Any]] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.original = read = FileTensor.read  # the strategy's setup runs after this hook: the load is seen

        def recorded(tensor: FileTensor, files: Any, index: list[torch.Tensor]) -> torch.Tensor:
            entry = self.reads.setdefault(tensor.key, {"shape": list(tensor.shape), "reads": []})
            entry["reads"].append([_runs(i) for i in index])
            return read(tensor, files, index)

        FileTensor.read = recorded  # type: ignore[method-assign]

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        FileTensor.read = self.original  # type: ignore[method-assign]
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / f"reads-rank{trainer.global_rank}.json").write_text(json.dumps(self.reads))


def layout(module: torch.nn.Module) -> dict[str, Any]:
    """params: {name: {mesh dim: placement} (empty for a plain tensor), full and rank-local shape}; fsdp: the
    FSDPModule names; moe: {MoE layer: its dispatcher's class and ep}; attention: the transformers model's
    attn_implementation (context parallel names its own); checkpointed: the modules activation checkpointing wraps."""
    params = {}
    for name, param in module.named_parameters():
        sharded = isinstance(param, DTensor)
        params[name] = {
            "placements": dict(zip(param.device_mesh.mesh_dim_names, map(str, param.placements))) if sharded else {},
            "shape": list(param.shape),
            "local_shape": list((param.to_local() if sharded else param).shape),
        }
    configs = (getattr(sub, "config", None) for sub in module.modules())
    attention = next((c._attn_implementation for c in configs if hasattr(c, "_attn_implementation")), None)
    return {
        "attention": attention,
        "params": params,
        "fsdp": [name for name, sub in module.named_modules() if isinstance(sub, FSDPModule)],
        "checkpointed": [name for name, sub in module.named_modules() if checkpoint.state(sub) is not None],
        "moe": {
            name: {"dispatcher": type(sub.dispatcher).__name__, "ep": getattr(sub.dispatcher, "ep", 1)}
            for name, sub in module.named_modules()
            if hasattr(sub, "dispatcher")
        },
    }


if __name__ == "__main__":
    out, runs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    errors: dict[str, dict[str, str]] = {}
    for spec in runs:
        if spec["kind"] == "fit":
            # --ckpt_path=@NAME: the checkpoint an earlier run of this launch wrote last
            args = [
                f"--ckpt_path={sorted((out / a[13:]).rglob('*.ckpt'))[-1]}" if a.startswith("--ckpt_path=@") else a
                for a in spec["args"]
            ]
            run_fit(out, spec["name"], [*args, RECORD_LAYOUT])
        elif spec["kind"] == "example":
            script, *args = spec["args"]
            load(script).main([*args, "--out", str(out / f"{spec['name']}.json")])
        elif spec["kind"] == "predict":
            run_fit(out, spec["name"], spec["args"], command="predict")
        else:
            try:
                run_cli(["fit", *spec["args"]])
                errors[spec["name"]] = {"type": "", "message": "no error"}
            except Exception as error:  # noqa: BLE001 - recorded for the test to judge
                errors[spec["name"]] = {"type": type(error).__name__, "message": str(error)}
    if errors and (not dist.is_initialized() or dist.get_rank() == 0):
        world = dist.get_world_size() if dist.is_initialized() else 1
        (out / f"errors_{world}.json").write_text(json.dumps(errors))
    exit_skipping_teardown()
