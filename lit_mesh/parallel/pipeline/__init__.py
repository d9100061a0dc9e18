"""Pipeline parallelism (pp) inside Lightning's own loop, with torch.distributed.pipelining as the engine.

- api.py: what a LightningModule calls (`loss_of`, `output_of`, ...), and the step scope MeshStrategy enters;
- runner.py: this rank's stages and torch's schedule over the micro-batches (the batch's way in training);
- twobw.py: PipeDream-2BW, the sibling runner (asynchronous 1F1B, updates one step late);
- schedules.py: the schedules offered and `PipelineSettings`; rules.py: what they combine with;
- split.py: which blocks each stage holds; sequential.py: a plain nn.Sequential cut by its children, without a plan;
  p2p.py: tensors between stages; moe.py: pp x MoE's statistics; torch_stage.py: torch's stage, its shape
  inference on zeros.

The names below import lazily from their module, so that lit_mesh.rules can read rules.py without the runners.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "loss_of": "api",
    "output_of": "api",
    "is_pipelined": "api",
    "microbatches": "api",
    "sum_over_stages": "api",
    "start_pipeline": "api",
    "pipeline_scope": "api",
    "PipelineRunner": "runner",
    "ScheduleRunner": "runner",
    "TwoBWRunner": "twobw",
    "SCHEDULES": "schedules",
    "SPLIT_BACKWARD": "schedules",
    "PipelineSettings": "schedules",
    "check_pipeline_settings": "schedules",
    "fewest_microbatches": "schedules",
    "microbatch_problem": "schedules",
    "Stage": "split",
    "Placement": "split",
    "PipelineConfigError": "split",
    "balanced_split": "split",
    "check_split": "split",
    "parameter_balanced_split": "split",
    "sequential_owners": "sequential",
    "SEQUENTIAL_PLAN": "sequential",
    "stage_ranks": "split",
    "split_into_stages": "split",
    "carry_moe_statistics": "moe",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_mesh.parallel.pipeline' has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
