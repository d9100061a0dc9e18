"""MeshMonitor: throughput, MFU, memory and communication per mesh dim, logged to any Lightning logger."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mesh.mesh import MeshAxis as A
from lit_mesh.monitor.comm import CollectiveBytes
from lit_mesh.monitor.peak_flops import peak_bf16_flops
from lit_mesh.monitor.pipeline_timeline import TimelineRecorder, bubble_formula
from lit_mesh.training.log_steps import log_every_n_steps

# which group names count for which mesh dim: the first view that owns a group names it
_VIEW_ORDER = (A.TP, A.CP, A.EP, A.DP_SHARD_CP, A.DP_SHARD, A.DP_REPLICATE, A.DP, A.DP_CP, A.PP)


def default_tokens_in_batch(batch: Any) -> tuple[int, int]:
    """(tokens, sequence length) of a local batch: B*T for a (B, T) token tensor first, else B samples."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return first.numel(), first.shape[1]
    return (len(first), 1)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory of this process: CUDA's allocator peak, or the peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class RoutingLayer(torch.nn.Module):
    """An MoE layer as moe_layers finds it: a type only (the layers are the model's own classes)."""

    n_experts: int
    load: torch.Tensor  # global tokens per expert of the last forward
    aux_loss: torch.Tensor


def moe_layers(module: torch.nn.Module) -> list[RoutingLayer]:
    """The MoE layers under `module`: what records its routing as zoo.moe.MoE does (n_experts, load, aux_loss)."""
    return [
        cast(RoutingLayer, m)
        for m in module.modules()
        if isinstance(getattr(m, "n_experts", None), int)
        and isinstance(getattr(m, "load", None), torch.Tensor)
        and isinstance(getattr(m, "aux_loss", None), torch.Tensor)
    ]


def moe_balance(layers: list[RoutingLayer]) -> dict[str, Any]:
    """Tokens per expert summed over layers, mean and worst max/mean over layers, and the summed aux loss."""
    load = torch.stack([m.load.detach().float().cpu() for m in layers])  # (layers, experts), global counts
    imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
    return {
        "tokens_per_expert": load.sum(dim=0).tolist(),
        "imbalance": imbalance.mean().item(),
        "imbalance_max": imbalance.max().item(),
        "aux_loss": sum(m.aux_loss.detach().float().item() for m in layers),
    }


def _default_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_bf16_flops(name)
    if peak is None:
        rank_zero_warn(f"MeshMonitor: no peak FLOP/s known for {name!r}: no MFU; pass MeshMonitor(peak_flops=...)")
    return peak


class _WindowTimer:
    """Elapsed time between open() and close(): CUDA events on a GPU (read once, at elapsed()), else `clock`."""

    def __init__(self, device: torch.device, clock: Callable[[], float]) -> None:
        self.cuda = device.type == "cuda"
        self.clock = clock
        self._start: Any = None
        self._end: Any = None

    def open(self) -> None:
        self._start = self._mark()

    def close(self) -> None:
        self._end = self._mark()

    def _mark(self) -> Any:
        if not self.cuda:
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self) -> float:
        if self.cuda:
            self._end.synchronize()  # the one wait, on a logging step
            return self._start.elapsed_time(self._end) / 1e3
        return self._end - self._start


class MeshMonitor(Callback):
    """Log throughput, efficiency, memory and communication per mesh dim of a run.

    Logs on every logged training step (Trainer `log_every_n_steps`):

    Timing is taken over a window: from the start of the first step after a logging step to the start of the
    next logging step (the steps between, with their data loading), by CUDA events on a GPU (read once per
    window) or `perf_counter` on CPU; step time, tokens/s, FLOP/s and MFU are the window's averages. The logging
    step itself is not timed: it counts the bytes of its collectives (a dispatch mode, ~20 us per op) and, under
    pp, records the bubble. With log_every_n_steps=1 there is no step between: each step is timed whole, bytes
    counting included (a warning says so).

    monitor/step_time_s, tokens_per_s (global; also in the progress bar), monitor/tokens_per_s_per_device,
    monitor/tflops_per_device (achieved model FLOP/s), monitor/mfu (when the device peak is known),
    monitor/peak_memory_gib (the largest over ranks), monitor/comm_mib/<dim> (MiB each rank sends in that
    step over the groups of each mesh dim, largest over ranks; ring-algorithm model of the measured
    collective sizes). Under pp > 1 also monitor/pp_bubble (1 - busy / step time of the F/B/W blocks this rank
    ran inside the schedule, largest over ranks) and monitor/pp_bubble_formula (the schedule's textbook value,
    `lit_mesh.monitor.pipeline_timeline.bubble_formula`; absent for zbv/dualpipev). Timing the blocks wraps the stage
    methods for the logged steps only (plus a device synchronisation per block on GPU); `measure_pp_bubble=False`
    turns it off. With MoE layers (modules that keep `n_experts`, the global `load` of tokens per expert and
    their `aux_loss` of the last forward, as zoo.moe.MoE does): monitor/moe_tokens_per_expert/<i> (global batch,
    summed over MoE layers), monitor/moe_imbalance (max / mean tokens per expert, mean over layers),
    monitor/moe_imbalance_max (the worst layer) and monitor/moe_aux_loss (sum over layers, mean over ranks).

    Model FLOPs per token come from the LightningModule's `flops_per_token(seq_len)` when it has one (the zoo
    modules do), else 6 x parameters. Tokens per batch come from its `tokens_in_batch(batch)` -> (tokens,
    seq_len) when it has one, else B*T of a (B, T) token tensor or B samples.
    """

    def __init__(
        self,
        peak_flops: float | None = None,
        measure_comm: bool = True,
        measure_pp_bubble: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.peak_flops = peak_flops  # dense bf16 FLOP/s of one device; None: from the device name (peak_flops.py)
        self.measure_comm = measure_comm
        self.measure_pp_bubble = measure_pp_bubble
        self._recorder: TimelineRecorder | None = None
        self._clock = clock
        self._measuring = False  # this step is a logging step: bytes counted, metrics logged at its end
        self._comm: CollectiveBytes | None = None
        self._dim_of_group: dict[str, str] = {}
        self._dims: list[str] = []
        self._moe: list[RoutingLayer] | None = None  # found at the first measured step (after configure_model)

    # ---- setup ---------------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.peak_flops is None:
            self.peak_flops = _default_peak_flops(pl_module.device)
        self._timer = _WindowTimer(pl_module.device, self._clock)
        self._window_steps, self._window_tokens, self._window_open = 0, 0, False
        if log_every_n_steps(trainer) == 1:
            rank_zero_warn(
                "MeshMonitor with log_every_n_steps=1: every step is timed with its bytes counted (a"
                " dispatch mode in the timed step); log_every_n_steps >= 2 times the steps between"
            )
        self._dim_of_group = {}
        views = getattr(trainer.strategy, "mesh_views", None)
        if views is not None:
            for name in _VIEW_ORDER:
                mesh = views[name]
                if mesh.size() > 1:
                    self._dim_of_group.setdefault(mesh.get_group().group_name, name)
            for name in (A.DP_REPLICATE, A.DP_SHARD_CP):  # HSDP/DDP reduce over the 2D view's own groups
                if views.hsdp[name].size() > 1:
                    self._dim_of_group.setdefault(views.hsdp.get_group(name).group_name, name)
        reductions = getattr(trainer.strategy, "reductions", None)
        for h in reductions.hierarchies() if reductions is not None else []:  # hierarchical: node-local, cross-node
            self._dim_of_group.setdefault(h.intra.group_name, f"{h.axis}:intra")
            self._dim_of_group.setdefault(h.inter.group_name, f"{h.axis}:inter")
        self._dims = sorted(set(self._dim_of_group.values())) + ["other"]

    def data_replicas(self, trainer: L.Trainer) -> int:
        """How many ranks read distinct data: all but the TP and PP ranks of one replica."""
        layout = getattr(trainer.strategy, "layout", None)
        if layout is None:
            return trainer.world_size
        return trainer.world_size // (layout.tp * layout.pp)

    # ---- per step ------------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._measuring = False
        if not trainer._logger_connector.should_update_logs:  # a step of the timed window
            if not self._window_open:
                self._timer.open()
                self._window_open, self._window_steps, self._window_tokens = True, 0, 0
            return
        if self._window_open and self._window_steps:  # the window ends where this logging step starts
            self._timer.close()
        else:  # no step between two logging steps: time this one
            self._timer.open()
            self._window_steps = 0
        self._window_open = False
        if self.measure_comm and dist.is_initialized():
            self._comm = CollectiveBytes()
            self._comm.__enter__()
        runner = getattr(trainer.strategy, "_pipeline", None)
        if self.measure_pp_bubble and runner is not None and runner.recorder is None:  # None: a PipelineTimeline has it
            self._recorder = runner.recorder = TimelineRecorder(runner, pl_module.device, count_saved=False)
        self._measuring = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        count = getattr(pl_module, "tokens_in_batch", default_tokens_in_batch)
        if not self._measuring:
            if self._window_open:
                self._window_steps += 1
                self._window_tokens += count(batch)[0]
            return
        sent = self._stop_counting()
        bubble = self._stop_recording()
        if not self._window_steps:  # timed whole (log_every_n_steps=1)
            self._timer.close()
            self._window_steps, self._window_tokens = 1, count(batch)[0]
        window_time = self._timer.elapsed()
        step_time = window_time / self._window_steps
        metrics = self.step_metrics(
            trainer, pl_module, batch, step_time, sent, bubble, self._window_tokens / self._window_steps
        )
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=name == "tokens_per_s")
        self._window_steps = self._window_tokens = 0

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._stop_counting()
        self._stop_recording()

    def _stop_recording(self) -> tuple[float, float | None] | None:
        """(measured bubble fraction of this rank, the schedule's formula) of the step just run, if recorded."""
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return None
        runner = recorder.runner
        if runner.recorder is recorder:
            runner.recorder = None
        if recorder.step_time <= 0:  # the schedule did not run under it (e.g. a PipelineTimeline took its place)
            return None
        formula = bubble_formula(
            runner.settings.schedule, runner.pp, runner.n_microbatches, runner.settings.local_stages()
        )
        return recorder.summary()["bubble_fraction"], formula

    def _stop_counting(self) -> dict[str, float]:
        if self._comm is None:
            return {}
        self._comm.__exit__(None, None, None)
        sent, self._comm = dict(self._comm.sent), None
        return sent

    # ---- the numbers ---------------------------------------------------------------------------------

    def step_metrics(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        step_time: float,
        sent: dict[str, float],
        bubble: tuple[float, float | None] | None = None,
        local_tokens: float | None = None,
    ) -> dict[str, float]:
        """local_tokens: this rank's tokens per step (the window's mean; default: this batch's)."""
        count = getattr(pl_module, "tokens_in_batch", default_tokens_in_batch)
        batch_tokens, seq_len = count(batch)
        local_tokens = batch_tokens if local_tokens is None else local_tokens
        tokens = local_tokens * self.data_replicas(trainer)
        # context parallel hands each rank 1/cp of every sequence; attention FLOPs grow with the whole length
        layout = getattr(trainer.strategy, "layout", None)
        flops_per_token = self.flops_per_token(pl_module, seq_len * (layout.cp if layout is not None else 1))
        world = trainer.world_size
        metrics = {
            "monitor/step_time_s": step_time,
            "tokens_per_s": tokens / step_time,
            "monitor/tokens_per_s_per_device": tokens / step_time / world,
            "monitor/tflops_per_device": tokens * flops_per_token / step_time / world / 1e12,
        }
        if self.peak_flops:
            metrics["monitor/mfu"] = tokens * flops_per_token / step_time / world / self.peak_flops
        per_rank = [float(peak_memory_bytes(pl_module.device))]
        if self.measure_comm:
            by_dim = dict.fromkeys(self._dims, 0.0)
            for group, nbytes in sent.items():
                dim = self._dim_of_group.get(group, "other")
                by_dim[dim] = by_dim.get(dim, 0.0) + nbytes
            per_rank += [by_dim[d] for d in self._dims]
        if bubble is not None:  # every rank records the same steps, so the lists stay the same length
            per_rank.append(bubble[0])
        largest = self._max_over_ranks(per_rank, pl_module.device)
        metrics["monitor/peak_memory_gib"] = largest[0] / 2**30
        if self.measure_comm:
            metrics.update({f"monitor/comm_mib/{d}": v / 2**20 for d, v in zip(self._dims, largest[1:])})
        metrics.update(self.moe_metrics(pl_module))
        if bubble is not None:
            metrics["monitor/pp_bubble"] = largest[-1]
            if bubble[1] is not None:
                metrics["monitor/pp_bubble_formula"] = bubble[1]
        return metrics

    def moe_metrics(self, pl_module: L.LightningModule) -> dict[str, float]:
        if self._moe is None:
            self._moe = moe_layers(pl_module)
        if not self._moe:
            return {}
        balance = moe_balance(self._moe)
        # the load is global already; the aux loss uses this rank's router probabilities: mean over ranks
        aux = torch.tensor(balance["aux_loss"], dtype=torch.float64, device=pl_module.device)
        if dist.is_initialized():
            dist.all_reduce(aux)
            aux /= dist.get_world_size()
        metrics = {f"monitor/moe_tokens_per_expert/{i}": n for i, n in enumerate(balance["tokens_per_expert"])}
        metrics.update(
            {
                "monitor/moe_imbalance": balance["imbalance"],
                "monitor/moe_imbalance_max": balance["imbalance_max"],
                "monitor/moe_aux_loss": aux.item(),
            }
        )
        return metrics

    @staticmethod
    def flops_per_token(pl_module: L.LightningModule, seq_len: int) -> float:
        declared = getattr(pl_module, "flops_per_token", None)
        if callable(declared):
            return float(declared(seq_len))
        return 6.0 * sum(p.numel() for p in pl_module.parameters())  # DTensor numel is the global size

    @staticmethod
    def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
        if not dist.is_initialized():
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()
