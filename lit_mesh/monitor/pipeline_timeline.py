"""See the pipeline bubble: what each rank computes when, during one training step.

`PipelineTimeline` (a callback) records, on every rank, the start and end of each forward (F), backward (B: the
input gradient, or the whole backward) and weight-gradient (W, zero-bubble schedules) block of one step, and
rank 0 draws them as a PNG per rank over time and writes the figures as JSON: step time, busy time and the
idle fraction (the bubble). Recording adds a device synchronisation per block on GPU: it is a diagnostic, on
for the one step it draws.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lit_mesh.extras import pyplot
from lit_mesh.monitor.figures import log_image
from lit_mesh.parallel.pipeline import PipelineRunner

# the stage methods torch's schedules call for each block of work, and the letter each block gets
_BLOCKS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


def bubble_formula(schedule: str, p: int, m: int, v: int = 1) -> Optional[float]:
    """The textbook bubble (idle fraction) of a pipeline schedule.

    The textbook idle fraction of a schedule with p stage ranks, m micro-batches and v stages per rank, for
    equal F / B / W block times; None for the V-shaped schedules (zbv, dualpipev), which have no such closed form.

    gpipe, 1f1b (p-1)/(m+p-1); interleaved_1f1b, looped_bfs (p-1)/(v m+p-1); zero_bubble (interleaved, ZB-H1
    shape: only F + B - W of each warm-up slot stays idle) (p-1)/(3 v m+p-1); 2bw (no flush) 0 after step 0.
    """
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / (3 * v * m + p - 1)
    if schedule == "2bw":  # no flush: after step 0's warm-up every stage alternates F and B without idling
        return 0.0
    return None


@dataclass
class Block:
    """One forward (F), backward (B) or weight-gradient (W) block that a rank ran in the step."""

    kind: str  # F, B or W
    stage: int
    microbatch: int
    start: float  # seconds from the start of the step
    end: float


class _Held:
    """A tensor autograd saved for backward; freed with the graph that holds it."""

    def __init__(self, tensor: torch.Tensor, counter: _SavedBytes) -> None:
        self.tensor, self.counter = tensor, counter
        self.nbytes = tensor.numel() * tensor.element_size()
        counter.alive += self.nbytes
        counter.peak = max(counter.peak, counter.alive)

    def __del__(self) -> None:
        self.counter.alive -= self.nbytes


class _SavedBytes:
    """The most bytes autograd holds for backward during a step.

    Bytes of the tensors autograd holds for backward, at most, during the step (activation memory; a
    storage saved twice counts twice).
    """

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> _Held:
        return _Held(tensor, self)

    @staticmethod
    def unpack(held: _Held) -> torch.Tensor:
        return held.tensor


class TimelineRecorder:
    """Times every F/B/W block of this rank's stages for the steps run inside `recording()`."""

    def __init__(self, runner: PipelineRunner, device: torch.device, count_saved: bool = True) -> None:
        self.runner = runner
        self.device = device
        self.count_saved = count_saved  # False: no saved-tensor hook (MeshMonitor needs only the block times)
        self.blocks: list[Block] = []
        self.step_time = 0.0
        self.peak_saved_bytes = 0
        self._t0 = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _wrap(self, stage: Any, method: str) -> None:
        original = getattr(stage, method)
        kind = _BLOCKS[method]

        def timed(chunk: int, *args: Any, **kwargs: Any) -> Any:
            self._sync()
            start = time.perf_counter()
            try:
                return original(chunk, *args, **kwargs)
            finally:
                self._sync()
                input_grad_only = kind == "B" and not kwargs.get("full_backward", True)
                label = "I" if input_grad_only else kind  # I: input gradient only (zero bubble)
                self.blocks.append(
                    Block(label, stage.stage_index, chunk, start - self._t0, time.perf_counter() - self._t0)
                )

        setattr(stage, method, timed)  # an instance attribute hides the method until removed

    @contextmanager
    def timed_block(self, kind: str, stage: int, microbatch: int) -> Iterator[None]:
        """One block a runner without torch stages computes itself (2bw), inside `recording()`."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.blocks.append(Block(kind, stage, microbatch, start - self._t0, time.perf_counter() - self._t0))

    @contextmanager
    def recording(self) -> Iterator[None]:
        for stage in self.runner.stages:
            for method in _BLOCKS:
                self._wrap(stage, method)
        saved = _SavedBytes()
        self.blocks = []
        self._sync()
        self._t0 = time.perf_counter()
        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
                if self.count_saved
                else nullcontext()
            ):
                yield
        finally:
            self._sync()
            self.step_time = time.perf_counter() - self._t0
            self.peak_saved_bytes = saved.peak
            for stage in self.runner.stages:
                for method in _BLOCKS:
                    delattr(stage, method)

    def summary(self) -> dict[str, Any]:
        busy = sum(b.end - b.start for b in self.blocks)
        return {
            "step_time_s": self.step_time,
            "busy_s": busy,
            "bubble_fraction": 1.0 - busy / self.step_time if self.step_time > 0 else 0.0,
            "peak_saved_activation_bytes": self.peak_saved_bytes,
            "blocks": [asdict(b) for b in self.blocks],
        }


def draw_timeline(per_rank: list[dict[str, Any]], title: str, path: Path) -> None:
    """One row per rank, one bar per block (F blue, B/I orange, W green), labelled with its micro-batch."""
    plt = pyplot()
    colours = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.7 * len(per_rank)))
    for rank, summary in enumerate(per_rank):
        for block in summary["blocks"]:
            width = block["end"] - block["start"]
            ax.broken_barh(
                [(block["start"], width)], (rank - 0.4, 0.8), color=colours[block["kind"]], edgecolor="black", lw=0.3
            )
            ax.text(
                block["start"] + width / 2,
                rank,
                f"{block['kind']}{block['microbatch']}",
                ha="center",
                va="center",
                fontsize=6,
            )
    ax.set_yticks(
        range(len(per_rank)), [f"pp rank {r}\nbubble {s['bubble_fraction']:.0%}" for r, s in enumerate(per_rank)]
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    ax.set_title(title + "   (F forward, B backward, I input grad, W weight grad; label: micro-batch)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class PipelineTimeline(Callback):
    """Draw one training step of a pipelined run: each rank's forward/backward blocks over time.

    Record one training step of a pipelined run and save `pipeline_timeline.png` + `.json` in `dirpath`; the
    picture also goes to the run's loggers that take images (TensorBoard: the `pipeline_timeline` image).

    Args:
        dirpath: where to write (default: the trainer's log directory).
        step: the global step to record (after warm-up: shapes inferred, caches warm).
    """

    def __init__(self, dirpath: Optional[str] = None, step: int = 3) -> None:
        self.dirpath = dirpath
        self.step = step
        self._recording: Any = None
        self._recorder: Optional[TimelineRecorder] = None
        self.summaries: list[dict[str, Any]] = []  # per pp rank, after the recorded step (every rank)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        runner = getattr(trainer.strategy, "_pipeline", None)
        if runner is None or trainer.global_step != self.step or self._recorder is not None:
            return
        self._recorder = TimelineRecorder(runner, pl_module.device)
        runner.recorder = self._recorder

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is None or recorder.runner.recorder is None:
            return
        recorder.runner.recorder = None
        gathered: list[Any] = [None] * dist.get_world_size(recorder.runner.group)
        dist.all_gather_object(gathered, recorder.summary(), group=recorder.runner.group)
        self.summaries = gathered
        if trainer.global_rank == 0:
            out = Path(self.dirpath or trainer.log_dir or ".")
            out.mkdir(parents=True, exist_ok=True)
            settings = recorder.runner.settings
            title = f"{settings.schedule}, pp={recorder.runner.pp}, {recorder.runner.n_microbatches} micro-batches"
            draw_timeline(gathered, title, out / "pipeline_timeline.png")
            log_image(trainer, "pipeline_timeline", out / "pipeline_timeline.png", trainer.global_step)
            (out / "pipeline_timeline.json").write_text(json.dumps({"title": title, "ranks": gathered}, indent=1))
