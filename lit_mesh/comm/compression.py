"""Gradient compression for data-parallel reductions: one `CompressionRun` per training run (options, schedule,
bytes meter, checkpointable state) and one `CompressionSite` per reduction site (its error-feedback residual and
each scheme's state), made by `run.site(name)`.

A site reduces any flat tensor over any process group, so it serves FSDP2's reduce-scatter seam, the DDP/HSDP
replicate all-reduce hook (lit_mesh/comm/fsdp.py) and callers of their own (e.g. the inter-node all-reduce of a
hierarchical all-reduce):

    site.reduce_scatter(output, input, group, average=True, dim="dp_shard")
    site.all_reduce(tensor, group, average=True, dim="dp_replicate")      # in place
    site.all_reduce_many([t1, t2, ...], group, dim="dp_replicate")         # fused into buckets

Schemes, each one class: the chunk codecs (fp16/bf16 `CastCodec`, 1-bit `SignCodec`, top-k `TopKCodec`, in
codecs.py) reduced by `CodecReduction` (codec_reduction.py), `PowerSGD` (powersgd.py); "none" (warm-up) is the
plain collective. The schedule (schedule.py) says which one runs at each step.
Error feedback: residual = what this rank meant to send - what it did send; added to the next input.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lit_mesh.comm.codec_reduction import CodecReduction, padded
from lit_mesh.comm.codecs import Codec, CodecSettings, make_codec
from lit_mesh.comm.entry_scales import EntryScales
from lit_mesh.comm.fusion import plan_buckets
from lit_mesh.comm.meter import WireMeter
from lit_mesh.comm.options import CompressionOptions
from lit_mesh.comm.powersgd import PowerSGD, Segment, segments_of_shapes
from lit_mesh.comm.schedule import CompressionSchedule

INTRA_SUFFIX = ":intra"


class CompressionSite:
    """One reduction site: its worker residual (input layout), the codec reductions' gather-half residual,
    PowerSGD's Q per matrix, 1-bit's per-entry scales."""

    def __init__(self, name: str, run: CompressionRun, fixed_mode: Optional[str] = None) -> None:
        self.name = name
        self.run = run
        self.fixed_mode = fixed_mode  # a node-local site's own codec (CompressionOptions.intra_mode)
        self.residual: Optional[Tensor] = None
        self.codec_reduction = CodecReduction(run.options.error_feedback)
        self.powersgd = PowerSGD(name, run.options)
        self.entry_scales: Optional[EntryScales] = None

    @property
    def mode(self) -> str:
        return self.fixed_mode or self.run.mode

    # ---- public entry points ---------------------------------------------------------------------------

    @torch.no_grad()
    def all_gather(self, piece: Tensor, group: Any, dim: str) -> Tensor:
        """Every rank's piece, end to end, sent as codes (the gather half of a codec all-reduce, with its residual)."""
        n = group.size()
        self.run.meter.uncompressed(dim, "all_gather", piece.numel() * n * piece.element_size(), n)
        return self.codec_reduction.all_gather(piece, n, group, self.run.codec(self.mode), self.run.meter, dim)

    @torch.no_grad()
    def reduce_scatter(
        self,
        output: Tensor,
        input: Tensor,
        group: Any,
        average: bool,
        dim: str,
        segments: Optional[list[Segment]] = None,
        final: bool = True,
    ) -> None:
        """output = (sum or mean over ranks of input)[chunk of this rank]; input is n chunks laid end to end.

        final=False: an all-reduce follows (HSDP), so the schedule's gradient statistics are taken there."""
        n = group.size()
        meter = self.run.meter
        meter.uncompressed(dim, "reduce_scatter", input, n)
        self._observe(input)
        x = self._with_residual(input)
        mode = self.mode
        if mode == "none":
            result = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
            dist.reduce_scatter_tensor(result, x, group=group)
            meter.sent(dim, "reduce_scatter", x, n)
        else:
            if mode == "powersgd":
                result, sent = self.powersgd.reduce(x, n, group, dim, segments, dist.get_rank(group), meter)
            else:
                scales = self._scales(n, group, dim)
                result, sent = self.codec_reduction.reduce_scatter(
                    x, n, group, self.run.codec(mode), scales, meter, dim
                )
            self._keep(x, sent)
        output.copy_(result / n if average else result)
        if final:
            self.run.schedule.record_norm(output)

    @torch.no_grad()
    def all_reduce(
        self, tensor: Tensor, group: Any, average: bool, dim: str, segments: Optional[list[Segment]] = None
    ) -> None:
        """tensor <- sum (or mean) over ranks of tensor, in place."""
        n = group.size()
        meter = self.run.meter
        meter.uncompressed(dim, "all_reduce", tensor, n)
        self._observe(padded(tensor, n))
        x = self._with_residual(tensor)
        mode = self.mode
        if mode in ("none", "powersgd"):
            self.codec_reduction.fold_server_residual(x, n, group, average)
        if mode == "none":
            dist.all_reduce(x, group=group)
            meter.sent(dim, "all_reduce", x, n)
            result = x
        elif mode == "powersgd":
            result, sent = self.powersgd.reduce(x, n, group, dim, segments, None, meter)
            self._keep(x, sent)
        else:
            scales = self._scales(n, group, dim)
            result, sent = self.codec_reduction.all_reduce(
                x, n, group, self.run.codec(mode), scales, meter, dim, average
            )
            self._keep(x, sent)
            average = False  # the codec all-reduce averages before re-encoding
        if average:
            result = result / n
        tensor.copy_(result)
        self.run.schedule.record_norm(tensor)

    def all_reduce_many(self, tensors: list[Tensor], group: Any, dim: str, average: bool = True) -> None:
        """All-reduce a list of tensors: small ones fused into buckets of `bucket_mb`, each bucket compressed
        as one buffer (PowerSGD keeps every tensor's own matrix shape)."""
        cap = int(self.run.options.bucket_mb * 2**20)
        itemsize = tensors[0].element_size() if tensors else 4
        for i, members in enumerate(plan_buckets([t.numel() for t in tensors], itemsize, cap)):
            bucket = [tensors[j] for j in members]
            site = self if i == 0 else self.run.site(f"{self.name}/bucket{i}")
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
        self.residual = None if self.mode == "none" else self.residual
        return out

    def _keep(self, meant: Tensor, sent: Tensor) -> None:
        if self.run.options.error_feedback:
            self.residual = meant - sent

    # ---- 1-bit's per-entry scales (onebit_rms_refresh > 0; lit_mesh/comm/entry_scales.py) -------------------

    def _observe(self, gradient: Tensor) -> None:
        # also before 1-bit starts (warm-up, earlier phases), so that its first shared scales have a history
        refresh = self.run.options.onebit_rms_refresh
        if refresh and self.run.schedule.onebit_scheduled:
            self.entry_scales = self.entry_scales or EntryScales(refresh)
            self.entry_scales.observe(gradient)

    def _scales(self, n: int, group: Any, dim: str) -> Optional[Tensor]:
        if self.entry_scales is None or self.mode != "onebit":
            return None
        sent = lambda buffer: self.run.meter.sent(dim, "all_gather", buffer, n)  # noqa: E731
        return self.entry_scales.scales(n, group, self.run.schedule.step, sent)


class CompressionRun:
    """The run's compression: the schedule (current mode), every site's state, the bytes meter."""

    def __init__(self, options: CompressionOptions, device: torch.device | str = "cpu") -> None:
        self.options = options
        self.device = torch.device(device)
        self.schedule = CompressionSchedule(options.phases(), self.device)
        self.meter = WireMeter()
        self.sites: dict[str, CompressionSite] = {}
        self._codecs: dict[str, Codec] = {}
        # the random bits of int8/int4 rounding and random-k draws: on the device (no host sync), its own per rank
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._generator = torch.Generator(device=self.device).manual_seed(options.seed * 65537 + rank)

    @property
    def mode(self) -> str:
        return self.schedule.mode

    def codec(self, mode: Optional[str] = None) -> Codec:
        """The codec of `mode` (default: the schedule's current one)."""
        mode = mode or self.mode
        if mode not in self._codecs:
            o = self.options
            settings = CodecSettings(
                o.onebit_block,
                o.topk_ratio,
                o.onebit_scale,
                o.quant_block,
                o.randomk_ratio,
                o.threshold,
                o.threshold_capacity,
            )
            self._codecs[mode] = make_codec(mode, settings, self._generator)
        return self._codecs[mode]

    def site(self, name: str) -> CompressionSite:
        if name not in self.sites:  # "<site>:intra": the node-local half of a hierarchical all-reduce, own codec
            fixed = self.options.intra_mode if name.endswith(INTRA_SUFFIX) else None
            self.sites[name] = CompressionSite(name, self, fixed_mode=fixed)
        return self.sites[name]

    def intra_site(self, name: str) -> Optional[CompressionSite]:
        """The node-local site beside site `name` of a hierarchical all-reduce, when intra_mode is set and the
        schedule compresses at all now (warm-up and "none" phases stay exact inside the node too)."""
        if self.options.intra_mode is None or self.mode == "none":
            return None
        return self.site(name + INTRA_SUFFIX)

    def begin_step(self, step: int) -> None:
        """Called at every training step (micro-batches of one step: once); moves along the schedule."""
        if step == self.schedule.step:
            return
        self.meter.end_step()
        self.schedule.advance(step)

    def metrics(self) -> dict[str, float]:
        """Loggable: bytes per mesh dim of the last complete step, the ratio, the schedule's phase."""
        self.meter.end_step()
        return {**self.meter.metrics(), "grad_compression/phase": float(self.schedule.index)}

    # ---- checkpoint state ------------------------------------------------------------------------------
    # keys as written before the renames ("compressors": the sites), so that earlier checkpoints load

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.schedule.state_dict(),
            "generator": self._generator.get_state(),
            "compressors": {
                name: {
                    "residual": s.residual,
                    "server_residual": s.codec_reduction.server_residual,
                    "qs": dict(s.powersgd.qs),
                    "entry_scales": None if s.entry_scales is None else s.entry_scales.state_dict(),
                }
                for name, s in self.sites.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any], sites: bool = True) -> None:
        """sites=False: only the schedule's position (residuals and factors stay as they are)."""
        self.schedule.load_state_dict(state)
        if not sites:
            return
        if "generator" in state:  # the random bits of this rank's codecs go on where they were
            self._generator.set_state(state["generator"].cpu())
        for name, saved in state["compressors"].items():
            site = self.site(name)
            move = lambda t: None if t is None else t.to(self.device)  # noqa: E731
            site.residual = move(saved["residual"])
            site.codec_reduction.server_residual = move(saved["server_residual"])
            site.powersgd.qs = {int(i): cast(Tensor, move(q)) for i, q in saved["qs"].items()}  # saved tensors
            if saved.get("entry_scales") is not None:
                site.entry_scales = EntryScales(self.options.onebit_rms_refresh)
                site.entry_scales.load_state_dict(saved["entry_scales"], self.device)
