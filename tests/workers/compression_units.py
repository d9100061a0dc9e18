"""Gradient-compression sites over a real gloo group (run by tests/integration/test_compression.py with 2 ranks).

Usage: torchrun --nproc_per_node=2 tests/workers/compression_units.py OUT_DIR CHECK[,CHECK...]
Each check is its own pytest id (tests/worker_checks.py); rank r writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_mesh.comm.codecs import CodecSettings, make_codec
from lit_mesh.comm.compression import CompressionRun
from lit_mesh.comm.powersgd import Segment
from lit_mesh.comm.options import CompressionOptions, CompressionPhase
from tests.workers.checks import Checks, arguments, assert_close_reduction

check = Checks()


def gathered(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return out


def inputs(length: int, step: int = 0) -> list[torch.Tensor]:
    """Every rank's input (each rank draws all of them: the formulas need them all)."""
    return [torch.randn(length, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(dist.get_world_size())]


def roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x), x.numel(), x.dtype)


@check
def onebit_all_reduce_formula() -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    run = CompressionRun(CompressionOptions(mode="onebit", onebit_block=64, onebit_rms_refresh=0))
    site, codec = run.site("ar"), make_codec("onebit", CodecSettings(onebit_block=64))
    xs = inputs(1000)
    out = xs[me].clone()
    site.all_reduce(out, dist.group.WORLD, average=True, dim="dp_replicate")
    # scatter half: every rank's chunks as sent; rank j sums chunk j; gather half: the mean chunk re-encoded
    sent = [torch.cat([roundtrip(codec, c) for c in x.view(n, -1)]) for x in xs]
    means = (torch.stack(sent).sum(0) / n).view(n, -1)
    expected = torch.cat([roundtrip(codec, m) for m in means])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(site.residual, xs[me] - sent[me], rtol=0, atol=0)
    torch.testing.assert_close(site.codec_reduction.server_residual, means[me] - roundtrip(codec, means[me]), rtol=0, atol=0)
    # bytes: n-1 of the n 1-bit payloads out in each half, against a ring all-reduce of fp32
    payload = codec.payload_bytes(1000 // n)
    got = run.meter.current["dp_replicate"]
    assert got["sent"] == 2 * (n - 1) * payload, got
    assert got["uncompressed"] == 2 * (n - 1) / n * 4000, got


@check
def onebit_scaled_by_entry_rms() -> None:
    """onebit_rms_refresh: the RMS of chunk j comes from rank j's own gradients (8-bit log codes, all-gathered),
    every entry is divided by it before its sign is taken and multiplied back after; error feedback stays exact;
    the codes are sent again only once `refresh` steps have passed, and their bytes are counted."""
    from lit_mesh.comm.entry_scales import FLOOR, decode_log, encode_log

    n, me = dist.get_world_size(), dist.get_rank()
    run = CompressionRun(CompressionOptions(mode="onebit", onebit_block=64, onebit_rms_refresh=2))
    site, codec = run.site("ar"), make_codec("onebit", CodecSettings(onebit_block=64))
    # entries of very different but steady sizes in one block (as gradients are, step to step): what the
    # per-entry scales are for
    sizes = 10 ** (4 * torch.rand(1000, generator=torch.Generator().manual_seed(3)) - 3)  # 1e-3 .. 10, mixed
    xs = [sizes * (x.sign() + 0.2 * x) for x in inputs(1000)]
    run.begin_step(0)
    out = xs[me].clone()
    site.all_reduce(out, dist.group.WORLD, average=True, dim="dp_replicate")
    rms = torch.cat([decode_log(encode_log(xs[r].view(n, -1)[r].abs())) for r in range(n)]).view(n, -1)
    scales = torch.maximum(rms, FLOOR * rms.mean(1, keepdim=True))
    sent = [torch.cat([roundtrip(codec, c / s) * s for c, s in zip(x.view(n, -1), scales)]) for x in xs]
    means = (torch.stack(sent).sum(0) / n).view(n, -1)
    expected = torch.cat([roundtrip(codec, m / s) * s for m, s in zip(means, scales)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(site.residual, xs[me] - sent[me], rtol=1e-6, atol=1e-7)
    # decoded entries keep their own size: relative to each entry's size (what AdamW sees), far closer to the
    # mean input than with one scale per block
    plain = CompressionRun(CompressionOptions(mode="onebit", onebit_block=64, onebit_rms_refresh=0)).site("ar")
    unscaled = xs[me].clone()
    plain.all_reduce(unscaled, dist.group.WORLD, average=True, dim="dp_replicate")
    mean_x = sum(xs) / n
    scaled_error, plain_error = (((y - mean_x) / sizes).norm() / (mean_x / sizes).norm() for y in (out, unscaled))
    assert scaled_error < 0.5 * plain_error, (float(scaled_error), float(plain_error))
    codes_bytes = (n - 1) / n * 1000  # one 8-bit code per entry, all-gathered
    payload = codec.payload_bytes(1000 // n)
    assert run.meter.current["dp_replicate"]["sent"] == 2 * (n - 1) * payload + codes_bytes, run.meter.current
    for step, shares in [(1, False), (2, True)]:  # refresh=2: the codes go out again at step 2, not at step 1
        run.begin_step(step)
        site.all_reduce(xs[me].clone(), dist.group.WORLD, average=True, dim="dp_replicate")
        extra = run.meter.current["dp_replicate"]["sent"] - 2 * (n - 1) * payload
        assert extra == (codes_bytes if shares else 0), (step, extra)


def reduce_scatter_formula(mode: str) -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    run = CompressionRun(CompressionOptions(mode=mode, topk_ratio=0.1, onebit_rms_refresh=0))
    site, codec = run.site("rs"), run.codec()
    xs = inputs(1200)
    out = torch.empty(1200 // n)
    site.reduce_scatter(out, xs[me], dist.group.WORLD, average=True, dim="dp_shard")
    expected = torch.stack([roundtrip(codec, x.view(n, -1)[me]) for x in xs]).sum(0) / n
    assert_close_reduction(out, expected, terms=n)  # the collective sums the n ranks in its own order
    mine = torch.cat([roundtrip(codec, c) for c in xs[me].view(n, -1)])
    assert torch.equal(site.residual + mine, xs[me]) or mode == "onebit"


@check
def powersgd_sums_rank_r_matrices_exactly() -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    shared = torch.randn(64, 3, generator=gen)
    ms = [shared @ torch.randn(3, 40, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]
    bias = [torch.randn(40, generator=torch.Generator().manual_seed(20 + r)) for r in range(n)]
    mean_m, mean_b = sum(ms) / n, sum(bias) / n
    run = CompressionRun(CompressionOptions(mode="powersgd", powersgd_rank=3))
    # all-reduce: one matrix and one 1-D tensor (sent uncompressed)
    flat = torch.cat([ms[me].flatten(), bias[me]])
    run.site("ar").all_reduce(flat, dist.group.WORLD, True, "dp_replicate", [Segment(0, 64, 40), Segment(2560, 40, 1)])
    torch.testing.assert_close(flat[:2560].view(64, 40), mean_m, rtol=1e-4, atol=1e-5)
    assert_close_reduction(flat[2560:], mean_b, terms=n)
    # reduce-scatter: rank j keeps rows of chunk j
    out = torch.empty(2560 // n)
    run.site("rs").reduce_scatter(out, ms[me].flatten(), dist.group.WORLD, True, "dp_shard", [Segment(0, 64 // n, 40)])
    torch.testing.assert_close(out.view(-1, 40), mean_m.view(n, -1, 40)[me], rtol=1e-4, atol=1e-5)
    sent = run.meter.current["dp_shard"]["sent"]
    assert sent < run.meter.current["dp_shard"]["uncompressed"] / 4, run.meter.current


@check
def nothing_lost_across_steps_and_switches() -> None:
    """mean input + what was held back before == output + what is held back now, at every step, through
    onebit -> topk -> powersgd -> fp16 -> int8 -> int4 -> randomk -> threshold -> onebit -> none (residuals
    carried, the server's folded back)."""
    n, me = dist.get_world_size(), dist.get_rank()
    modes = ["onebit", "topk", "powersgd", "fp16", "int8", "int4", "randomk", "threshold", "onebit", "none"]
    phases = [CompressionPhase(m, start_step=i) for i, m in enumerate(modes) if i]
    options = CompressionOptions(mode=modes[0], topk_ratio=0.05, onebit_block=32, onebit_rms_refresh=0, schedule=phases)
    run = CompressionRun(options)
    site = run.site("ar")
    length = 64 * 48

    def held_back() -> torch.Tensor:
        worker = site.residual if site.residual is not None else torch.zeros(length)
        total = worker.clone()
        dist.all_reduce(total)
        total /= n
        server = site.codec_reduction.server_residual if site.codec_reduction.server_residual is not None else torch.zeros(length // n)
        return total + torch.cat(gathered(server))

    for step, mode in enumerate(modes):
        run.begin_step(step)
        assert run.mode == mode, (step, run.mode, mode)
        x = inputs(length, step)[me].double()
        before = held_back() if step else torch.zeros(length, dtype=torch.float64)
        if site.residual is not None:
            site.residual = site.residual.double()
        if site.codec_reduction.server_residual is not None:
            site.codec_reduction.server_residual = site.codec_reduction.server_residual.double()
        mean_x = x.clone()
        dist.all_reduce(mean_x)
        mean_x /= n
        out = x.clone()
        site.all_reduce(out, dist.group.WORLD, True, "dp_replicate", [Segment(0, 64, 48)])
        after = held_back().double()
        torch.testing.assert_close(out + after, mean_x + before.double(), rtol=0, atol=1e-9, msg=f"step {step} {mode}")
    assert site.residual is None and site.codec_reduction.server_residual is None, "uncompressed sends flush every residual"


@check
def none_is_the_plain_collective() -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    run = CompressionRun(CompressionOptions(warmup_steps=3, bucket_mb=100 / 2**20))  # 100-byte buckets
    run.begin_step(0)
    assert run.mode == "none"
    xs = inputs(600)
    out = torch.empty(600 // n)
    run.site("rs").reduce_scatter(out, xs[me], dist.group.WORLD, True, "dp_shard")
    assert_close_reduction(out, (sum(xs) / n).view(n, -1)[me], terms=n)
    tensors = [xs[me][:10].clone(), xs[me][10:600].clone().view(59, 10)]
    run.site("many").all_reduce_many(tensors, dist.group.WORLD, "dp_replicate")
    assert_close_reduction(torch.cat([t.flatten() for t in tensors]), sum(xs) / n, terms=n)
    assert sorted(run.sites) == ["many", "many/bucket1", "rs"]  # 40 bytes, then 2360 bytes alone


@check
def schedule_switches_by_rule_on_all_ranks_together() -> None:
    phase = CompressionPhase("onebit", grad_norm_change_below=0.5, patience=2)
    run = CompressionRun(CompressionOptions(mode="fp16", schedule=[phase]))
    site = run.site("ar")
    seen = []
    for step in range(6):
        run.begin_step(step)
        seen.append(run.mode)
        # rank 1's gradients swing more than rank 0's, but the decision is taken on the world's norm
        x = torch.full((100,), 1.0 + 0.01 * step * (1 + dist.get_rank()))
        site.all_reduce(x, dist.group.WORLD, True, "dp_replicate")
    modes = [None] * dist.get_world_size()
    dist.all_gather_object(modes, seen)
    assert all(m == modes[0] for m in modes), modes
    assert seen == ["fp16", "fp16", "fp16", "onebit", "onebit", "onebit"], seen


def sent_formula(mode: str, options: dict) -> None:
    """Any codec, random ones included: the reduce-scatter gives the mean over ranks of what each rank sent (its
    input less its residual), and the all-reduce sends (n-1) payloads in each half; bytes against the formula."""
    n, me = dist.get_world_size(), dist.get_rank()
    run = CompressionRun(CompressionOptions(mode=mode, **options))
    xs = inputs(1200)
    out = torch.empty(1200 // n)
    site = run.site("rs")
    site.reduce_scatter(out, xs[me], dist.group.WORLD, average=True, dim="dp_shard")
    sent = [x - r for x, r in zip(xs, gathered(site.residual))]
    assert_close_reduction(out, (sum(sent) / n).view(n, -1)[me], terms=n)
    assert not torch.equal(sent[me], xs[me]), "the codec must drop something"
    payload = run.codec().payload_bytes(1200 // n)
    assert run.meter.current["dp_shard"]["sent"] == (n - 1) * payload, run.meter.current
    x = xs[me].clone()
    run.site("ar").all_reduce(x, dist.group.WORLD, average=True, dim="dp_replicate")
    assert run.meter.current["dp_replicate"]["sent"] == 2 * (n - 1) * payload, run.meter.current
    assert torch.equal(torch.stack(gathered(x))[0], x), "every rank ends with the same reduced gradient"


@check
def int8_sent_formula() -> None:
    sent_formula("int8", {"quant_block": 64})


@check
def int4_sent_formula() -> None:
    sent_formula("int4", {"quant_block": 64})


@check
def randomk_sent_formula() -> None:
    sent_formula("randomk", {"randomk_ratio": 0.1})


@check
def threshold_sent_formula() -> None:
    sent_formula("threshold", {"threshold": 1.0, "threshold_capacity": 0.2})


@check
def topk_reduce_scatter_formula() -> None:
    reduce_scatter_formula("topk")


@check
def fp16_reduce_scatter_formula() -> None:
    reduce_scatter_formula("fp16")


@check
def onebit_reduce_scatter_formula() -> None:
    reduce_scatter_formula("onebit")


if __name__ == "__main__":
    out_dir, selected = arguments()
    check.run_on_gloo(out_dir, selected)
