"""Gradient compression for data-parallel reductions: one `GradientCompression` per run (mode, schedule,
bytes meter, checkpointable state) and one `GradientCompressor` per reduction site (its residuals and
PowerSGD factors).

A compressor reduces any flat tensor over any process group, so it serves FSDP2's reduce-scatter seam, the
DDP/HSDP replicate all-reduce hook (lit_mesh/comm/fsdp.py) and callers of their own (e.g. the inter-node
step of a hierarchical all-reduce):

    compressor.reduce_scatter(output, input, group, average=True, dim="dp_shard")
    compressor.all_reduce(tensor, group, average=True, dim="dp_replicate")      # in place
    compressor.all_reduce_many([t1, t2, ...], group, dim="dp_replicate")         # fused into buckets

Schemes (the chunk codecs are in codecs.py, PowerSGD in powersgd.py):
- fp16/bf16, onebit, topk: every rank encodes each of the n chunks of its (error-corrected) input and sends
  chunk j to rank j by all-to-all; rank j decodes and sums them locally (codes of signs or top-k entries do
  not add up on the wire). That is the reduce-scatter. An all-reduce then re-encodes the reduced chunk (with
  a second, rank-local residual: error feedback on both sides) and all-gathers the codes.
- powersgd: P and Q all-reduced per matrix; for a reduce-scatter each rank keeps the rows of its chunk.
- none (warm-up): the plain collective.
Error feedback: residual = what this rank meant to send - what it did send; added to the next input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lit_mesh.comm.codecs import Codec, make_codec
from lit_mesh.comm.entry_scales import EntryScales
from lit_mesh.comm.fusion import fused, plan_buckets
from lit_mesh.comm.meter import WireMeter
from lit_mesh.comm.options import CompressionOptions
from lit_mesh.comm.powersgd import initial_q, low_rank_sum, worth_compressing


@dataclass(frozen=True)
class Segment:
    """A matrix inside each chunk of a flat buffer: `rows x cols` entries from `offset` (row-major)."""

    offset: int
    rows: int
    cols: int


def segments_of_shapes(shapes: list[torch.Size]) -> list[Segment]:
    """Segments of tensors laid end to end (a 1-D tensor is a one-column matrix)."""
    out, offset = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) else 1
        out.append(Segment(offset, rows, numel // rows if rows else 0))
        offset += numel
    return out


class GradientCompressor:
    """Compression state of one reduction site: worker residual (input layout), server residual (this rank's
    chunk of a two-stage all-reduce), PowerSGD's Q per matrix, 1-bit's per-entry scales."""

    def __init__(self, name: str, run: GradientCompression) -> None:
        self.name = name
        self.run = run
        self.residual: Optional[Tensor] = None
        self.server_residual: Optional[Tensor] = None
        self.qs: dict[int, Tensor] = {}
        self.entry_scales: Optional[EntryScales] = None

    # ---- public entry points ---------------------------------------------------------------------------

    @torch.no_grad()
    def reduce_scatter(
        self, output: Tensor, input: Tensor, group: Any, average: bool, dim: str,
        segments: Optional[list[Segment]] = None, final: bool = True,
    ) -> None:  # fmt: skip
        """output = (sum or mean over ranks of input)[chunk of this rank]; input is n chunks laid end to end.

        final=False: an all-reduce follows (HSDP), so the schedule's gradient statistics are taken there."""
        n = group.size()
        self.run.meter.uncompressed(dim, "reduce_scatter", input, n)
        self._observe(input)
        x = self._with_residual(input)
        mode = self.run.mode
        if mode == "none":
            result = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(result, x, group=group)
            self.run.meter.sent(dim, "reduce_scatter", x, n)
        elif mode == "powersgd":
            result = self._powersgd(x, n, group, dim, segments, keep_chunk=dist.get_rank(group))
        else:
            result = self._stage_one(x, n, group, dim, self._scales(n, group, dim))
        output.copy_(result / n if average else result)
        if final:
            self.run.record_norm(output)

    @torch.no_grad()
    def all_reduce(
        self, tensor: Tensor, group: Any, average: bool, dim: str, segments: Optional[list[Segment]] = None
    ) -> None:
        """tensor <- sum (or mean) over ranks of tensor, in place."""
        n = group.size()
        self.run.meter.uncompressed(dim, "all_reduce", tensor, n)
        self._observe(_padded(tensor, n))
        x = self._with_residual(tensor)
        mode = self.run.mode
        if mode in ("none", "powersgd"):
            self._fold_server_residual(x, n, group, average)
        if mode == "none":
            dist.all_reduce(x, group=group)
            self.run.meter.sent(dim, "all_reduce", x, n)
            result = x
        elif mode == "powersgd":
            result = self._powersgd(x, n, group, dim, segments, keep_chunk=None)
        else:
            result = self._codec_all_reduce(x, n, group, dim, average)
            average = False  # the two-stage reduction averages before re-encoding
        if average:
            result = result / n
        tensor.copy_(result)
        self.run.record_norm(tensor)

    def all_reduce_many(self, tensors: list[Tensor], group: Any, dim: str, average: bool = True) -> None:
        """All-reduce a list of tensors: small ones fused into buckets of `bucket_mb`, each bucket compressed
        as one buffer (PowerSGD keeps every tensor's own matrix shape)."""
        cap = int(self.run.options.bucket_mb * 2**20)
        itemsize = tensors[0].element_size() if tensors else 4
        for i, members in enumerate(plan_buckets([t.numel() for t in tensors], itemsize, cap)):
            bucket = [tensors[j] for j in members]
            site = self if i == 0 else self.run.compressor(f"{self.name}/bucket{i}")
            flat = torch.cat([t.reshape(-1) for t in bucket])
            site.all_reduce(flat, group, average, dim, segments_of_shapes([t.shape for t in bucket]))
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # ---- error feedback ----------------------------------------------------------------------------------

    def _with_residual(self, x: Tensor) -> Tensor:
        """The input plus what earlier steps could not send (a new tensor: the caller's input is not modified)."""
        if self.residual is None:
            return x.clone()
        if self.residual.shape != x.shape:
            raise RuntimeError(
                f"gradient compression site {self.name!r}: residual of {tuple(self.residual.shape)} entries but the"
                f" gradient buffer has {tuple(x.shape)}; the set of parameters with gradients changed between steps"
            )
        out = x + self.residual.to(x.dtype)
        self.residual = None if self.run.mode == "none" else self.residual
        return out

    def _keep(self, meant: Tensor, sent: Tensor) -> None:
        if self.run.options.error_feedback:
            self.residual = meant - sent

    # ---- codec schemes ----------------------------------------------------------------------------------

    def _encode_chunks(self, chunks: Tensor, codec: Codec) -> tuple[Tensor, Tensor]:
        """(payloads n x B, what the receivers will decode, n x c)."""
        payloads = torch.stack([codec.encode(chunk) for chunk in chunks])
        decoded = torch.stack([codec.decode(p, chunks.shape[1], chunks.dtype) for p in payloads])
        return payloads, decoded

    def _stage_one(self, x: Tensor, n: int, group: Any, dim: str, scales: Optional[Tensor]) -> Tensor:
        """Every rank's chunk j of x, encoded, sent to rank j and summed there: this rank's chunk of the sum.
        With per-entry `scales` (x's layout), x / scales is encoded and the decoded codes are multiplied back."""
        codec = self.run.codec()
        chunks = x.view(n, -1)
        unit = _per_chunk(scales, n, x)
        payloads, decoded = self._encode_chunks(chunks / unit, codec)
        self._keep(x, (decoded * unit).view(-1))
        received = torch.empty_like(payloads)
        dist.all_to_all_single(received, payloads, group=group)
        self.run.meter.sent(dim, "all_to_all", payloads, n)
        work = torch.promote_types(x.dtype, torch.float32)
        mine = unit[dist.get_rank(group)].to(work)
        return torch.stack([codec.decode(p, chunks.shape[1], work) for p in received]).sum(0) * mine

    # ---- 1-bit's per-entry scales (onebit_rms_refresh > 0; lit_mesh/comm/entry_scales.py) -------------------

    def _observe(self, gradient: Tensor) -> None:
        # also before 1-bit starts (warm-up, earlier stages), so that its first shared scales have a history
        refresh = self.run.options.onebit_rms_refresh
        if refresh and self.run.onebit_scheduled:
            self.entry_scales = self.entry_scales or EntryScales(refresh)
            self.entry_scales.observe(gradient)

    def _scales(self, n: int, group: Any, dim: str) -> Optional[Tensor]:
        if self.entry_scales is None or self.run.mode != "onebit":
            return None
        return self.entry_scales.scales(n, group, self.run.step, lambda b: self.run.meter.sent(dim, "all_gather", b, n))

    def _fold_server_residual(self, x: Tensor, n: int, group: Any, average: bool) -> None:
        """A scheme without a second stage takes over what the last two-stage all-reduce kept back: it joins
        this rank's input at its chunk (x n when averaging, so that the mean over ranks gains it)."""
        if self.server_residual is None:
            return
        chunk = self.server_residual.numel()
        start = dist.get_rank(group) * chunk
        part = x[start : start + chunk]
        part += (self.server_residual * (n if average else 1))[: part.numel()].to(x.dtype)
        self.server_residual = None

    def _codec_all_reduce(self, x: Tensor, n: int, group: Any, dim: str, average: bool) -> Tensor:
        length, chunk = x.numel(), math.ceil(x.numel() / n)
        padded = _padded(x, n)
        scales = self._scales(n, group, dim)
        reduced = self._stage_one(padded, n, group, dim, scales)
        if self.residual is not None:
            self.residual = self.residual[:length]  # the padding is no signal
        if average:
            reduced = reduced / n
        # stage two: re-encode this rank's reduced chunk (with its own residual) and gather every chunk
        codec = self.run.codec()
        unit = _per_chunk(scales, n, x)
        mine = unit[dist.get_rank(group)]
        if self.server_residual is not None:
            reduced = reduced + self.server_residual
        payload = codec.encode(reduced / mine)
        if self.run.options.error_feedback:
            self.server_residual = reduced - codec.decode(payload, chunk, reduced.dtype) * mine
        gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(gathered, payload, group=group)
        self.run.meter.sent(dim, "all_gather", gathered, n)
        parts = gathered.view(n, -1)
        return torch.cat([codec.decode(p, chunk, x.dtype) * unit[r] for r, p in enumerate(parts)])[:length]

    # ---- PowerSGD -------------------------------------------------------------------------------------------

    def _powersgd(
        self, x: Tensor, n: int, group: Any, dim: str, segments: Optional[list[Segment]], keep_chunk: Optional[int]
    ) -> Tensor:
        """keep_chunk None: all-reduce (x is one chunk); else reduce-scatter of x's n chunks to that chunk."""
        chunks = 1 if keep_chunk is None else n
        chunk_numel = x.numel() // chunks
        rank = self.run.options.powersgd_rank
        segments = segments or []
        if sum(s.rows * s.cols for s in segments) != chunk_numel or any(s.cols == 0 for s in segments):
            segments = []  # no matrix layout known: everything goes uncompressed
        per_chunk = x.view(chunks, chunk_numel)
        work = torch.promote_types(x.dtype, torch.float32)
        compressed = [i for i, s in enumerate(segments) if worth_compressing(chunks * s.rows, s.cols, rank)]
        mask = torch.zeros(chunk_numel, dtype=torch.bool, device=x.device)
        matrices = []
        for i in compressed:
            s = segments[i]
            mask[s.offset : s.offset + s.rows * s.cols] = True
            rows = per_chunk[:, s.offset : s.offset + s.rows * s.cols].reshape(chunks * s.rows, s.cols)
            matrices.append(rows.to(work))
            if i not in self.qs:
                self.qs[i] = initial_q(s.cols, rank, f"{self.name}/{i}", self.run.options.seed, x.device).to(work)
        cap = int(self.run.options.bucket_mb * 2**20)

        def all_reduce_sum(tensors: list[Tensor]) -> None:
            def one(flat: Tensor) -> None:
                dist.all_reduce(flat, group=group)
                self.run.meter.sent(dim, "all_reduce", flat, n)

            fused(tensors, cap, one)

        approximations = low_rank_sum(matrices, [self.qs[i] for i in compressed], all_reduce_sum)
        sent = torch.zeros_like(per_chunk)  # what this rank's input contributes to the result, input layout
        out_chunk = torch.zeros(chunk_numel, dtype=x.dtype, device=x.device)
        mine = 0 if keep_chunk is None else keep_chunk
        for i, approx in zip(compressed, approximations):
            s = segments[i]
            mean = approx / n  # every rank contributes the mean approximation; the sum is n times it
            sent[:, s.offset : s.offset + s.rows * s.cols] = mean.reshape(chunks, -1).to(x.dtype)
            out_chunk[s.offset : s.offset + s.rows * s.cols] = approx.reshape(chunks, -1)[mine].to(x.dtype)
        # the rest, uncompressed and exact: one collective for all of it (already fused in this buffer)
        rest = per_chunk[:, ~mask]
        sent[:, ~mask] = rest
        if rest.numel():
            if keep_chunk is None:
                reduced_rest = rest.reshape(-1).clone()
                dist.all_reduce(reduced_rest, group=group)
                self.run.meter.sent(dim, "all_reduce", reduced_rest, n)
            else:
                reduced_rest = torch.empty(rest.shape[1], dtype=x.dtype, device=x.device)
                dist.reduce_scatter_tensor(reduced_rest, rest.reshape(-1).contiguous(), group=group)
                self.run.meter.sent(dim, "reduce_scatter", rest, n)
            out_chunk[~mask] = reduced_rest
        self._keep(x, sent.view(-1))
        return out_chunk


def _per_chunk(scales: Optional[Tensor], n: int, x: Tensor) -> Tensor:
    """1-bit's per-entry scales as n chunk rows in x's dtype (ones, broadcast over each chunk, without scales)."""
    return torch.ones(n, 1, dtype=x.dtype, device=x.device) if scales is None else scales.view(n, -1).to(x.dtype)


def _padded(x: Tensor, n: int) -> Tensor:
    """x with zeros appended up to a multiple of n entries (n equal chunks)."""
    chunk = math.ceil(x.numel() / n)
    if x.numel() == n * chunk:
        return x
    out = torch.zeros(n * chunk, dtype=x.dtype, device=x.device)
    out[: x.numel()] = x
    return out


class GradientCompression:
    """The run's compression: current mode (from the schedule), every site's state, the bytes meter."""

    def __init__(self, options: CompressionOptions, device: torch.device | str = "cpu") -> None:
        self.options = options
        self.stages = options.stages()
        self.device = torch.device(device)
        self.stage = 0
        self.step = -1
        self.meter = WireMeter()
        self.compressors: dict[str, GradientCompressor] = {}
        self._codecs: dict[str, Codec] = {}
        # squared norm of this rank's reduced gradients in the current step, on the device: no host read per bucket
        self._sumsq = torch.zeros((), dtype=torch.float64, device=self.device)
        self._last_norm: Optional[float] = None
        self._calm_steps = 0

    @property
    def mode(self) -> str:
        return self.stages[self.stage].mode

    @property
    def onebit_scheduled(self) -> bool:
        """1-bit now or in a later stage of the schedule."""
        return any(stage.mode == "onebit" for stage in self.stages[self.stage :])

    def codec(self) -> Codec:
        if self.mode not in self._codecs:
            self._codecs[self.mode] = make_codec(
                self.mode, self.options.onebit_block, self.options.topk_ratio, self.options.onebit_scale
            )
        return self._codecs[self.mode]

    def compressor(self, name: str) -> GradientCompressor:
        if name not in self.compressors:
            self.compressors[name] = GradientCompressor(name, self)
        return self.compressors[name]

    # ---- the schedule ---------------------------------------------------------------------------------------

    @property
    def _rule_pending(self) -> bool:
        nxt = self.stages[self.stage + 1] if self.stage + 1 < len(self.stages) else None
        return nxt is not None and nxt.grad_norm_change_below is not None

    def record_norm(self, reduced: Tensor) -> None:
        if self._rule_pending:
            self._sumsq = self._sumsq + reduced.detach().float().pow(2).sum().double()

    def begin_step(self, step: int) -> None:
        """Called at every training step (micro-batches of one step: once); moves along the schedule."""
        if step == self.step:
            return
        self.meter.end_step()
        if self._rule_pending and self.step >= 0:
            self._observe_grad_norm()
        self.step = step
        while self.stage + 1 < len(self.stages):
            nxt = self.stages[self.stage + 1]
            by_step = nxt.start_step is not None and step >= nxt.start_step
            by_rule = nxt.grad_norm_change_below is not None and self._calm_steps >= nxt.patience
            if not (by_step or by_rule):
                break
            self.stage += 1
            self._calm_steps, self._last_norm = 0, None

    def _observe_grad_norm(self) -> None:
        # every rank must switch at the same step: decide on the norm summed over the world
        total = self._sumsq.reshape(1).to(self.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        norm, self._sumsq = float(total.sqrt()), torch.zeros((), dtype=torch.float64, device=self.device)
        threshold = self.stages[self.stage + 1].grad_norm_change_below
        if self._last_norm is not None and self._last_norm > 0:
            calm = abs(norm - self._last_norm) / self._last_norm < threshold
            self._calm_steps = self._calm_steps + 1 if calm else 0
        self._last_norm = norm

    def metrics(self) -> dict[str, float]:
        """Loggable: bytes per mesh dim of the last complete step, the ratio, the schedule's stage."""
        self.meter.end_step()
        return {**self.meter.metrics(), "grad_compression/stage": float(self.stage)}

    # ---- checkpoint state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "step": self.step,
            "sumsq": float(self._sumsq),
            "last_norm": self._last_norm,
            "calm_steps": self._calm_steps,
            "compressors": {
                name: {
                    "residual": c.residual, "server_residual": c.server_residual, "qs": dict(c.qs),
                    "entry_scales": None if c.entry_scales is None else c.entry_scales.state_dict(),
                }
                for name, c in self.compressors.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any], sites: bool = True) -> None:
        """sites=False: only the schedule's position (residuals and factors stay as they are)."""
        self.stage, self.step = state["stage"], state["step"]
        self._last_norm, self._calm_steps = state["last_norm"], state["calm_steps"]
        self._sumsq = torch.tensor(float(state["sumsq"]), dtype=torch.float64, device=self.device)
        if not sites:
            return
        for name, saved in state["compressors"].items():
            site = self.compressor(name)
            move = lambda t: None if t is None else t.to(self.device)  # noqa: E731
            site.residual, site.server_residual = move(saved["residual"]), move(saved["server_residual"])
            site.qs = {int(i): move(q) for i, q in saved["qs"].items()}
            if saved.get("entry_scales") is not None:
                site.entry_scales = EntryScales(self.options.onebit_rms_refresh)
                site.entry_scales.load_state_dict(saved["entry_scales"], self.device)
