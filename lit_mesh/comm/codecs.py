"""Per-chunk gradient codecs: a vector in, a fixed-size byte payload out, and back.

Fixed-size payloads let a reduction send every rank's codes in one all-to-all with even splits. Payloads are
uint8 tensors whose length is a multiple of 4, so that fp32/int32 fields inside them stay aligned.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


class CastCodec:
    """fp16 / bf16: the entries themselves, in fewer bits."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def payload_bytes(self, n: int) -> int:
        return _align4(n * self.itemsize)

    def encode(self, x: Tensor) -> Tensor:
        out = torch.zeros(self.payload_bytes(x.numel()), dtype=torch.uint8, device=x.device)
        out[: x.numel() * self.itemsize] = x.to(self.dtype).view(torch.uint8)
        return out

    def decode(self, payload: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        return payload[: n * self.itemsize].view(self.dtype).to(dtype)


ONEBIT_SCALES = ("rms", "mean_abs")


class SignCodec:
    """1-bit: the sign of every entry (packed 8 per byte) and, per block of entries, one fp32 scale. Zero counts
    as positive. The scale is the block's root mean square ("rms": the decoded block keeps the squared sum that
    Adam's second moment sees) or its mean absolute value ("mean_abs": the least squared error of sign x scale,
    but under Adam it makes every coordinate look smaller than it is and so raises the effective lr)."""

    _SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)

    def __init__(self, block: int, scale: str = "rms") -> None:
        if scale not in ONEBIT_SCALES:
            raise ValueError(f"1-bit scale {scale!r}: choose one of {ONEBIT_SCALES}")
        self.block = block
        self.scale = scale

    def _blocks(self, n: int) -> int:
        return max(1, math.ceil(n / self.block))

    def payload_bytes(self, n: int) -> int:
        return 4 * self._blocks(n) + _align4(math.ceil(n / 8))

    def scales(self, x: Tensor) -> Tensor:
        """fp32 RMS (or mean |x|) of every block (the last block may be shorter)."""
        n, blocks = x.numel(), self._blocks(x.numel())
        padded = torch.zeros(blocks * self.block, dtype=torch.float32, device=x.device)
        padded[:n] = x.detach().float().square() if self.scale == "rms" else x.detach().abs().float()
        counts = torch.full((blocks,), float(self.block), device=x.device)
        counts[-1] = n - (blocks - 1) * self.block
        means = padded.view(blocks, self.block).sum(1) / counts
        return means.sqrt() if self.scale == "rms" else means

    def encode(self, x: Tensor) -> Tensor:
        n, blocks = x.numel(), self._blocks(x.numel())
        bits = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=x.device)
        bits[:n] = (x >= 0).to(torch.uint8)
        packed = (bits.view(-1, 8) << self._SHIFTS.to(x.device)).sum(1, dtype=torch.uint8)
        out = torch.zeros(self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        out[: 4 * blocks] = self.scales(x).view(torch.uint8)
        out[4 * blocks : 4 * blocks + packed.numel()] = packed
        return out

    def decode(self, payload: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        blocks = self._blocks(n)
        scales = payload[: 4 * blocks].view(torch.float32)
        packed = payload[4 * blocks : 4 * blocks + math.ceil(n / 8)]
        bits = ((packed.unsqueeze(1) >> self._SHIFTS.to(payload.device)) & 1).flatten()[:n]
        signs = bits.to(dtype) * 2 - 1
        return signs * scales.to(dtype).repeat_interleave(self.block)[:n]


class TopKCodec:
    """Top-k: the k = ceil(ratio x n) entries of largest magnitude, as fp32 values and int32 positions."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def k(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.ratio * n)))

    def payload_bytes(self, n: int) -> int:
        return 8 * self.k(n)

    def encode(self, x: Tensor) -> Tensor:
        k = self.k(x.numel())
        index = torch.topk(x.detach().abs(), k, sorted=False).indices
        out = torch.empty(8 * k, dtype=torch.uint8, device=x.device)
        out[: 4 * k] = x[index].float().view(torch.uint8)
        out[4 * k :] = index.to(torch.int32).view(torch.uint8)
        return out

    def decode(self, payload: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        k = self.k(n)
        values = payload[: 4 * k].view(torch.float32)
        index = payload[4 * k :].view(torch.int32).long()
        return torch.zeros(n, dtype=dtype, device=payload.device).index_put_((index,), values.to(dtype))


Codec = CastCodec | SignCodec | TopKCodec


def make_codec(mode: str, onebit_block: int, topk_ratio: float, onebit_scale: str = "rms") -> Codec:
    if mode == "fp16":
        return CastCodec(torch.float16)
    if mode == "bf16":
        return CastCodec(torch.bfloat16)
    if mode == "onebit":
        return SignCodec(onebit_block, onebit_scale)
    if mode == "topk":
        return TopKCodec(topk_ratio)
    raise ValueError(f"no chunk codec for mode {mode!r}")
