"""Gradient compression in one process: codecs, error feedback, PowerSGD, fusion, options, checkpoint state.
The compressors over real gloo groups: tests/integration/test_compression.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch.utils._python_dispatch import TorchDispatchMode

from lit_mesh import CompressionOptions, CompressionPhase, MeshStrategy
from lit_mesh.comm.codec_reduction import _encode_chunks
from lit_mesh.comm.codecs import CastCodec, Codec, QuantCodec, RandomKCodec, SignCodec, ThresholdCodec, TopKCodec
from lit_mesh.comm.fusion import fused, plan_buckets
from lit_mesh.comm.meter import WireMeter
from lit_mesh.comm.options import CompressionConfigError
from lit_mesh.comm.powersgd import PowerSGD, initial_q, low_rank_sum, segments_of_shapes
from lit_mesh.monitor.host_syncs import HostSyncCounter

GENERATOR = torch.Generator().manual_seed(0)
CODECS = {
    "fp16": CastCodec(torch.float16),
    "bf16": CastCodec(torch.bfloat16),
    "onebit": SignCodec(64),
    "topk": TopKCodec(0.05),
    "int8": QuantCodec(8, 64, GENERATOR),
    "int4": QuantCodec(4, 64, GENERATOR),
    "randomk": RandomKCodec(0.05, GENERATOR),
    "threshold": ThresholdCodec(1.0, 0.2),
}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_error_feedback_conserves_the_signal_exactly(name: str) -> None:
    codec = CODECS[name]
    # fp32 gradients as fp64 tensors: the residual arithmetic is then exact for every codec (1-bit's
    # sign x scale included); cast and top-k are exact in fp32 too
    for dtype in (torch.float64, torch.float32):
        x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).float().to(dtype)
        sent = codec.decode(codec.encode(x), x.numel(), dtype)
        residual = x - sent
        if dtype == torch.float32 and name in ("onebit", "int8", "int4"):
            continue  # x - level x scale rounds in fp32 (the residual is kept in the gradient's dtype)
        assert torch.equal(sent + residual, x), name
        assert not torch.equal(sent, x), "the codec must actually drop something"


def test_powersgd_reconstructs_a_rank_r_matrix_exactly_at_rank_r() -> None:
    gen = torch.Generator().manual_seed(1)
    for rank in (1, 4):
        m = torch.randn(48, rank, generator=gen, dtype=torch.float64) @ torch.randn(
            rank, 32, generator=gen, dtype=torch.float64
        )
        q = initial_q(32, rank, "site", 0, torch.device("cpu")).double()
        (approx,) = low_rank_sum([m], [q], lambda tensors: None)  # one rank: the sum is the matrix
        torch.testing.assert_close(approx, m, rtol=1e-10, atol=1e-10)
    # rank r cannot hold a rank r+1 matrix
    m = torch.randn(48, 5, generator=gen, dtype=torch.float64) @ torch.randn(5, 32, generator=gen, dtype=torch.float64)
    (approx,) = low_rank_sum([m], [initial_q(32, 4, "site", 0, torch.device("cpu")).double()], lambda t: None)
    assert (approx - m).norm() > 1e-3 * m.norm()


def test_topk_keeps_the_k_largest() -> None:
    x = torch.randn(997, generator=torch.Generator().manual_seed(2))
    codec = TopKCodec(0.03)
    k = codec.k(x.numel())
    assert k == math.ceil(0.03 * 997)
    decoded = codec.decode(codec.encode(x), x.numel(), torch.float32)
    kept = decoded.nonzero().flatten()
    assert sorted(kept.tolist()) == sorted(x.abs().topk(k).indices.tolist())
    assert torch.equal(decoded[kept], x[kept])
    assert codec.payload_bytes(997) == 8 * k


@pytest.mark.parametrize("scale", ["rms", "mean_abs"])
def test_onebit_codec_is_sign_times_block_scale(scale: str) -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(3))
    x[7] = 0.0
    codec = SignCodec(64, scale)
    decoded = codec.decode(codec.encode(x), 300, torch.float32)
    of_block = (lambda b: b.square().mean().sqrt()) if scale == "rms" else (lambda b: b.abs().mean())
    expected = torch.cat([of_block(x[i : i + 64]).expand(len(x[i : i + 64])) for i in range(0, 300, 64)])
    torch.testing.assert_close(decoded, torch.where(x >= 0, 1.0, -1.0) * expected)
    if scale == "rms":  # every block keeps its squared sum (what Adam's second moment sees)
        torch.testing.assert_close(decoded.square().sum(), x.square().sum())
    assert codec.payload_bytes(300) == 4 * 5 + 40  # 5 fp32 scales, 300 bits padded to whole words


def test_fusion_packs_small_tensors_into_buckets() -> None:
    assert plan_buckets([10, 10, 10, 100, 5], itemsize=4, cap_bytes=80) == [[0, 1], [2], [3], [4]]
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([3, 4, 50, 2])]
    calls = []
    fused(tensors, cap_bytes=40, collective=lambda flat: (calls.append(flat.numel()), flat.mul_(2)))
    assert calls == [7, 50, 2]
    assert [t.unique().item() for t in tensors] == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fp8", "grad_compression='fp8' is not a compression mode; choose one of 'fp16', 'bf16', 'powersgd'"),
        (CompressionOptions(mode="svd"), "grad_compression mode='svd' is not a compression mode"),
        (CompressionOptions(mode="powersgd", powersgd_rank=0), "powersgd_rank=0 must be an int >= 1"),
        (CompressionOptions(mode="topk", topk_ratio=0.0), "topk_ratio=0.0 must be in (0, 1]"),
        (CompressionOptions(mode="topk", topk_ratio=1.5), "topk_ratio=1.5 must be in (0, 1]"),
        (CompressionOptions(warmup_steps=-1), "warmup_steps=-1 must be an int >= 0"),
        (CompressionOptions(onebit_rms_refresh=-2), "onebit_rms_refresh=-2 must be an int >= 0"),
        (CompressionOptions(onebit_scale="max"), "onebit_scale='max' must be one of 'rms', 'mean_abs'"),
        (
            CompressionOptions(schedule=[CompressionPhase("onebit")]),
            "has neither start_step nor grad_norm_change_below",
        ),
        (
            CompressionOptions(warmup_steps=5, schedule=[CompressionPhase("fp16", start_step=2)]),
            "start_step=2 comes before",
        ),
    ],
)
def test_bad_compression_settings_fail_at_construction(value: object, message: str) -> None:
    with pytest.raises(CompressionConfigError) as error:
        MeshStrategy(grad_compression=value)
    assert message in str(error.value)


def test_compression_without_a_data_parallel_dim_fails_before_any_process_starts() -> None:
    with pytest.raises(CompressionConfigError) as error:
        Trainer(accelerator="cpu", devices=2, strategy=MeshStrategy(tp=2, grad_compression="onebit"), logger=False)
    assert "grad_compression='onebit' but the mesh has no data-parallel dim" in str(error.value)
    assert "give dp or dp_replicate > 1" in str(error.value)


def test_checkpoint_state_restores_on_the_same_layout_and_resets_with_a_warning_on_another(tmp_path: Path) -> None:
    from lit_mesh.comm.compression import CompressionRun
    from lit_mesh.comm.state import load_compression_state, save_compression_state

    saved = CompressionRun(CompressionOptions(mode="fp16", schedule=[CompressionPhase("onebit", start_step=3)]))
    site = saved.site("model.layers.0:reduce_scatter")
    site.residual, site.powersgd.qs = torch.randn(10), {0: torch.randn(4, 2)}
    saved.begin_step(0)
    saved.begin_step(3)  # now in the onebit phase
    save_compression_state(saved, tmp_path, rank=1, world_size=2, layout="dp_replicate=2")

    same = CompressionRun(saved.options)
    same.site("model.layers.0:reduce_scatter")
    assert load_compression_state(same, tmp_path, rank=1, world_size=2, layout="dp_replicate=2") is None
    assert torch.equal(same.sites["model.layers.0:reduce_scatter"].residual, site.residual)
    assert torch.equal(same.sites["model.layers.0:reduce_scatter"].powersgd.qs[0], site.powersgd.qs[0])
    assert (same.schedule.index, same.schedule.step, same.mode) == (1, 3, "onebit")

    other = CompressionRun(saved.options)
    other.site("model.layers.0:reduce_scatter")
    with pytest.warns(
        UserWarning, match="gradient compression starts afresh .* saved on 'dp_replicate=2', this run is 'dp=4'"
    ):
        why = load_compression_state(other, tmp_path, rank=1, world_size=4, layout="dp=4")
    assert why is not None
    assert other.sites["model.layers.0:reduce_scatter"].residual is None  # reset
    assert other.mode == "onebit"  # the schedule's position is kept


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_codes_are_unbiased_levels_within_their_block_scale(bits: int) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    codec = QuantCodec(bits, 100, torch.Generator().manual_seed(4))
    levels = 2 ** (bits - 1) - 1
    assert codec.payload_bytes(1000) == 4 * 10 + (1000 if bits == 8 else 500)
    scales = x.view(10, 100).abs().amax(1)
    draws = torch.stack([codec.decode(codec.encode(x), 1000, torch.float64) for _ in range(400)])
    step = (scales.double() / levels).repeat_interleave(100)
    codes = draws / step
    assert (
        torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= levels + 1e-4
    )  # whole levels in [-L, L]
    assert ((draws - x.double()).abs() <= step + 1e-6).all(), "rounding goes to a neighbouring level only"
    # unbiased: the mean of 400 draws is within 4 standard errors of x, everywhere
    assert ((draws.mean(0) - x.double()).abs() <= 4 * step / 2 / 400**0.5 + 1e-6).all()
    exact = (torch.arange(-levels, levels + 1).float() / levels).repeat(7)[:100]  # levels of scale 1 decode exactly
    torch.testing.assert_close(codec.decode(codec.encode(exact), 100, torch.float32), exact, rtol=1e-6, atol=1e-7)


def test_randomk_sends_k_distinct_entries_as_they_are() -> None:
    x = torch.randn(997, generator=torch.Generator().manual_seed(5))
    codec = RandomKCodec(0.03, torch.Generator().manual_seed(6))
    k = codec.k(997)
    first, second = (codec.decode(codec.encode(x), 997, torch.float32) for _ in range(2))
    for decoded in (first, second):
        kept = decoded.nonzero().flatten()
        assert kept.numel() == k and torch.equal(decoded[kept], x[kept])
    assert not torch.equal(first, second), "fresh positions at every call"
    assert codec.payload_bytes(997) == 8 * k


def test_threshold_sends_what_passes_up_to_its_capacity() -> None:
    x = torch.tensor([0.5, -2.0, 0.1, 3.0, -0.9, 1.0, 0.0, -1.5] * 10)
    roomy = ThresholdCodec(1.0, 0.5)  # room for 40 of 80 entries: the 40 passing ones all fit
    decoded = roomy.decode(roomy.encode(x), 80, torch.float32)
    assert torch.equal(decoded, torch.where(x.abs() >= 1.0, x, 0))
    tight = ThresholdCodec(1.0, 0.125)  # room for 10: the largest 10 of those passing
    decoded = tight.decode(tight.encode(x), 80, torch.float32)
    assert decoded.count_nonzero() == 10 and set(decoded[decoded != 0].abs().tolist()) == {3.0}
    assert tight.payload_bytes(80) == 8 * 10
    first = torch.tensor([5.0] + [0.0] * 79)  # a real entry at position 0 next to unused slots
    assert torch.equal(roomy.decode(roomy.encode(first), 80, torch.float32), first)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("randomk_ratio", 0.0, "randomk_ratio=0.0 must be in (0, 1]"),
        ("threshold_capacity", 2.0, "threshold_capacity=2.0 must be in (0, 1]"),
        ("threshold", -1.0, "threshold=-1.0 must be > 0"),
        ("quant_block", 0, "quant_block=0 must be an int >= 1"),
    ],
)
def test_bad_codec_settings_fail_at_construction(field: str, value: object, message: str) -> None:
    with pytest.raises(CompressionConfigError, match=re.escape(message)):
        MeshStrategy(dp_replicate=2, grad_compression=CompressionOptions(mode="int8", **{field: value}))


class _Kernels(TorchDispatchMode):
    """How many aten ops run (each a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n += 1
        return func(*args, **(kwargs or {}))


def _reduction_kernels(codec: Codec, ranks: int) -> int:
    chunks = torch.randn(ranks, 300)
    with _Kernels() as kernels:
        payloads, _ = _encode_chunks(chunks, codec)  # the sender: every peer's chunk
        codec.decode_rows(payloads, 300, torch.float32).sum(0)  # the receiver: every peer's payload
    return kernels.n


@pytest.mark.parametrize("name", [n for n in CODECS if n != "randomk"])  # random-k draws a permutation per chunk
def test_a_codec_reduction_launches_the_same_kernels_for_2_and_8_ranks(name: str) -> None:
    assert _reduction_kernels(CODECS[name], 2) == _reduction_kernels(CODECS[name], 8)


def test_onebit_codes_copy_no_constant_from_the_host() -> None:
    # on "meta" a host tensor moved to the device is seen as on a GPU (the shift constant was copied each call)
    x = torch.empty(300, device="meta")
    codec = SignCodec(64)
    with HostSyncCounter() as syncs:
        codec.decode(codec.encode(x), 300, torch.float32)
    assert syncs.total == 0, syncs.sites


def test_powersgd_reduces_without_a_host_sync() -> None:
    """No boolean mask (a nonzero per call) for the uncompressed rest: positions made on the device once."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        shapes = [torch.Size([32, 16]), torch.Size([16]), torch.Size([16, 24]), torch.Size([8])]
        segments = segments_of_shapes(shapes)
        x = torch.randn(sum(math.prod(s) for s in shapes))
        powersgd = PowerSGD("site", CompressionOptions(mode="powersgd", powersgd_rank=2))
        run = lambda: powersgd.reduce(x, 2, dist.group.WORLD, "dp", segments, None, WireMeter())  # noqa: E731
        run()
        with HostSyncCounter() as syncs:
            out, sent = run()
        assert syncs.total == 0, syncs.sites
        rest = torch.cat([x[512:528], x[912:]])  # the 1-D tensors, sent exactly (the fake group sums nothing)
        torch.testing.assert_close(torch.cat([out[512:528], out[912:]]), rest)
        torch.testing.assert_close(torch.cat([sent[512:528], sent[912:]]), rest)
    finally:
        dist.destroy_process_group()
