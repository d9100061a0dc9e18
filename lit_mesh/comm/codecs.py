"""Per-chunk gradient codecs: a vector in, a fixed-size byte payload out, and back.

Fixed-size payloads let a reduction send every rank's codes in one all-to-all with even splits. Payloads are
uint8 tensors whose length is a multiple of 4, so that fp32/int32 fields inside them stay aligned. Every codec
codes rows: `encode_rows` turns n chunks (n, c) into n payloads (n, B) and `decode_rows` back, each one batch of
kernels for all the chunks of a bucket (not one per chunk, i.e. per peer rank); `encode` / `decode` code one vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


def _as(rows: Tensor, dtype: torch.dtype) -> Tensor:
    """The bytes of each row (n, bytes) reinterpreted as `dtype` (rows must be whole elements of it)."""
    return rows.contiguous().view(dtype)


class _RowCodec:
    """encode / decode of one vector, as a one-row batch."""

    def encode_rows(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def decode_rows(self, payloads: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def encode(self, x: Tensor) -> Tensor:
        return self.encode_rows(x.reshape(1, -1))[0]

    def decode(self, payload: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        return self.decode_rows(payload.view(1, -1), n, dtype)[0]


class CastCodec(_RowCodec):
    """fp16 / bf16: the entries themselves, in fewer bits."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def payload_bytes(self, n: int) -> int:
        return _align4(n * self.itemsize)

    def encode_rows(self, x: Tensor) -> Tensor:
        rows, n = x.shape
        out = torch.zeros(rows, self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        out[:, : n * self.itemsize] = _as(x.to(self.dtype), torch.uint8)
        return out

    def decode_rows(self, payloads: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        return _as(payloads[:, : n * self.itemsize], self.dtype).to(dtype)


ONEBIT_SCALES = ("rms", "mean_abs")


class SignCodec(_RowCodec):
    """1-bit: the sign of every entry (packed 8 per byte) and, per block of entries, one fp32 scale. Zero counts
    as positive. The scale is the block's root mean square ("rms": the decoded block keeps the squared sum that
    Adam's second moment sees) or its mean absolute value ("mean_abs": the least squared error of sign x scale,
    but under Adam it makes every coordinate look smaller than it is and so raises the effective lr)."""

    def __init__(self, block: int, scale: str = "rms") -> None:
        if scale not in ONEBIT_SCALES:
            raise ValueError(f"1-bit scale {scale!r}: choose one of {ONEBIT_SCALES}")
        self.block = block
        self.scale = scale
        self._shifts: dict[torch.device, Tensor] = {}

    def shifts(self, device: torch.device) -> Tensor:
        """The bit positions 7..0 of a byte, made once per device on that device (no host-to-device copy per
        encode / decode)."""
        if device not in self._shifts:
            self._shifts[device] = torch.arange(7, -1, -1, dtype=torch.uint8, device=device)
        return self._shifts[device]

    def _blocks(self, n: int) -> int:
        return max(1, math.ceil(n / self.block))

    def payload_bytes(self, n: int) -> int:
        return 4 * self._blocks(n) + _align4(math.ceil(n / 8))

    def scales(self, x: Tensor) -> Tensor:
        """fp32 RMS (or mean |x|) of every block of every row of x (n, c) (the last block may be shorter)."""
        (rows, n), blocks = x.shape, self._blocks(x.shape[1])
        padded = torch.zeros(rows, blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:, :n] = x.detach().float().square() if self.scale == "rms" else x.detach().abs().float()
        counts = torch.full((blocks,), float(self.block), device=x.device)
        counts[-1] = n - (blocks - 1) * self.block
        means = padded.view(rows, blocks, self.block).sum(2) / counts
        return means.sqrt() if self.scale == "rms" else means

    def encode_rows(self, x: Tensor) -> Tensor:
        (rows, n), blocks, nbytes = x.shape, self._blocks(x.shape[1]), math.ceil(x.shape[1] / 8)
        bits = torch.zeros(rows, nbytes * 8, dtype=torch.uint8, device=x.device)
        bits[:, :n] = (x >= 0).to(torch.uint8)
        packed = (bits.view(rows, nbytes, 8) << self.shifts(x.device)).sum(2, dtype=torch.uint8)
        out = torch.zeros(rows, self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        out[:, : 4 * blocks] = _as(self.scales(x), torch.uint8)
        out[:, 4 * blocks : 4 * blocks + nbytes] = packed
        return out

    def decode_rows(self, payloads: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        blocks = self._blocks(n)
        scales = _as(payloads[:, : 4 * blocks], torch.float32)
        packed = payloads[:, 4 * blocks : 4 * blocks + math.ceil(n / 8)]
        bits = ((packed.unsqueeze(2) >> self.shifts(payloads.device)) & 1).flatten(1)[:, :n]
        signs = bits.to(dtype) * 2 - 1
        return signs * scales.to(dtype).repeat_interleave(self.block, dim=1)[:, :n]


class SparseCodec(_RowCodec):
    """k = ceil(ratio x n) entries as fp32 values, then their int32 positions (8 bytes an entry); subclasses choose
    which entries."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n)))

    def payload_bytes(self, n: int) -> int:
        return 8 * self.k(n)

    @staticmethod
    def _payloads(values: Tensor, index: Tensor) -> Tensor:
        """(rows, k) values and their positions -> (rows, 8k) payloads."""
        rows, k = values.shape
        out = torch.empty(rows, 8 * k, dtype=torch.uint8, device=values.device)
        out[:, : 4 * k] = _as(values.float(), torch.uint8)
        out[:, 4 * k :] = _as(index.to(torch.int32), torch.uint8)
        return out

    def decode_rows(self, payloads: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        k = self.k(n)
        values = _as(payloads[:, : 4 * k], torch.float32).to(dtype)
        index = _as(payloads[:, 4 * k :], torch.int32).long()
        zeros = torch.zeros(payloads.shape[0], n, dtype=dtype, device=payloads.device)
        return zeros.scatter_add_(1, index, values)


class TopKCodec(SparseCodec):
    """Top-k: the k = ceil(ratio x n) entries of largest magnitude."""

    def encode_rows(self, x: Tensor) -> Tensor:
        index = torch.topk(x.detach().abs(), self.k(x.shape[1]), dim=1, sorted=False).indices
        return self._payloads(x.detach().gather(1, index), index)


class QuantCodec(_RowCodec):
    """int8 / int4 (QSGD-style): per block of entries one fp32 scale (the block's largest |x|) and every entry as a
    signed integer level in [-L, L], L = 2^(bits-1) - 1, rounded stochastically: up with probability equal to the
    fraction past the lower level, so the decoded block is unbiased. int4 levels are packed two per byte."""

    def __init__(self, bits: int, block: int, generator: torch.Generator) -> None:
        if bits not in (4, 8):
            raise ValueError(f"quantisation to {bits} bits: choose 8 or 4")
        self.bits, self.block, self.generator = bits, block, generator
        self.levels = 2 ** (bits - 1) - 1

    def _blocks(self, n: int) -> int:
        return max(1, math.ceil(n / self.block))

    def _code_bytes(self, n: int) -> int:
        return n if self.bits == 8 else math.ceil(n / 2)

    def payload_bytes(self, n: int) -> int:
        return 4 * self._blocks(n) + _align4(self._code_bytes(n))

    def encode_rows(self, x: Tensor) -> Tensor:
        (rows, n), blocks = x.shape, self._blocks(x.shape[1])
        padded = torch.zeros(rows, blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:, :n] = x.detach().float()
        values = padded.view(rows, blocks, self.block)
        scales = values.abs().amax(2)
        level = values.abs() / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2) * self.levels
        # one draw for all rows: the generator's stream in the order of rows, as a draw per row would take it
        noise = torch.rand(level.shape, generator=self.generator, device=self.generator.device).to(x.device)
        codes = (torch.floor(level + noise).clamp_max(self.levels) * values.sign()).flatten(1)[:, :n].to(torch.int8)
        out = torch.zeros(rows, self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        out[:, : 4 * blocks] = _as(scales, torch.uint8)
        if self.bits == 8:
            out[:, 4 * blocks : 4 * blocks + n] = _as(codes, torch.uint8)
        else:  # two's-complement nibbles, low nibble first
            nibbles = torch.zeros(rows, 2 * self._code_bytes(n), dtype=torch.uint8, device=x.device)
            nibbles[:, :n] = _as(codes, torch.uint8) & 0xF
            out[:, 4 * blocks : 4 * blocks + self._code_bytes(n)] = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        return out

    def decode_rows(self, payloads: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        blocks = self._blocks(n)
        scales = _as(payloads[:, : 4 * blocks], torch.float32)
        raw = payloads[:, 4 * blocks : 4 * blocks + self._code_bytes(n)]
        if self.bits == 8:
            codes = _as(raw, torch.int8)
        else:
            nibbles = torch.stack([raw & 0xF, raw >> 4], 2).flatten(1)[:, :n].to(torch.int8)
            codes = torch.where(nibbles > 7, nibbles - 16, nibbles)
        step = (scales / self.levels).to(dtype).repeat_interleave(self.block, dim=1)[:, :n]
        return codes[:, :n].to(dtype) * step


class RandomKCodec(SparseCodec):
    """random-k: k = ceil(ratio x n) entries at positions drawn uniformly without replacement (on the device, from
    the run's generator: no host sync): top-k's bytes, without its selection. With error feedback the entries not
    drawn wait for a later step."""

    def __init__(self, ratio: float, generator: torch.Generator) -> None:
        super().__init__(ratio)
        self.generator = generator

    def encode_rows(self, x: Tensor) -> Tensor:
        (rows, n), k = x.shape, self.k(x.shape[1])
        # one permutation per row (torch draws no batch of permutations), then one gather for all rows
        draws = [torch.randperm(n, generator=self.generator, device=self.generator.device)[:k] for _ in range(rows)]
        index = torch.stack(draws).to(x.device)
        return self._payloads(x.detach().gather(1, index), index)


class ThresholdCodec(SparseCodec):
    """Threshold sparsification: the entries with |x| >= threshold. All-to-all needs payloads of one size, so a
    payload holds up to ceil(capacity x n) entries (the largest when more pass; with error feedback the rest wait)
    and its bytes are that capacity's, however few pass."""

    def __init__(self, threshold: float, capacity: float) -> None:
        super().__init__(capacity)
        self.threshold = threshold

    def encode_rows(self, x: Tensor) -> Tensor:
        top = torch.topk(x.detach().abs(), self.k(x.shape[1]), dim=1, sorted=False)
        passing = top.values >= self.threshold
        values = torch.where(passing, x.detach().gather(1, top.indices), 0)
        # unused slots: value 0 at position 0 (decode adds, so a real entry at position 0 is kept)
        return self._payloads(values, torch.where(passing, top.indices, 0))


Codec = CastCodec | SignCodec | TopKCodec | QuantCodec | RandomKCodec | ThresholdCodec


@dataclass(frozen=True)
class CodecSettings:
    """What the codecs read of CompressionOptions."""

    onebit_block: int = 256
    topk_ratio: float = 0.01
    onebit_scale: str = "rms"
    quant_block: int = 256
    randomk_ratio: float = 0.01
    threshold: float = 1e-3
    threshold_capacity: float = 0.05


def make_codec(
    mode: str, settings: CodecSettings = CodecSettings(), generator: Optional[torch.Generator] = None
) -> Codec:
    """The codec of `mode`; `generator` draws the random bits of int8/int4 and random-k (seed it per rank)."""
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    if mode == "fp16":
        return CastCodec(torch.float16)
    if mode == "bf16":
        return CastCodec(torch.bfloat16)
    if mode == "onebit":
        return SignCodec(settings.onebit_block, settings.onebit_scale)
    if mode == "topk":
        return TopKCodec(settings.topk_ratio)
    if mode in ("int8", "int4"):
        return QuantCodec(int(mode[3:]), settings.quant_block, generator)
    if mode == "randomk":
        return RandomKCodec(settings.randomk_ratio, generator)
    if mode == "threshold":
        return ThresholdCodec(settings.threshold, settings.threshold_capacity)
    raise ValueError(f"no chunk codec for mode {mode!r}")
