"""Context parallel in one process: how a sequence is split (positions, load balance of the causal ring) and what
context parallel refuses, with the fix (sequence lengths, attention it cannot split). Exact attention and loss
parity across ranks: tests/integration/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_mesh.parallel.context import (
    ContextParallelAttention,
    ContextParallelError,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from lit_mesh.parallel.context.apply import _swap_attention
from lit_mesh.parallel.context.attention import _ring_block

# ---- the layout of the sequence (no processes) ------------------------------------------------------------


@pytest.mark.parametrize("balanced", [True, False])
def test_shards_and_positions_cover_the_sequence(balanced: bool) -> None:
    cp, length = 4, 16
    x = torch.arange(length).repeat(2, 1)  # (batch, sequence)
    shards = [shard_sequence(x, cp, rank, balanced) for rank in range(cp)]
    assert torch.equal(unshard_sequence(shards, balanced), x)
    for rank, shard in enumerate(shards):  # the positions a rank is told are those of the tokens it holds
        assert torch.equal(local_positions(length // cp, cp, rank, balanced), shard[0])
    if balanced:  # rank 0 holds the first and the last chunk
        assert shards[0][0].tolist() == [0, 1, 14, 15]


def test_load_balanced_ring_gives_every_rank_the_same_work() -> None:
    cp, length = 4, 8  # local length: two chunks of 4
    for step in range(cp):
        work = set()
        for rank in range(cp):
            rows, cols, causal = _ring_block((rank - step) % cp, rank, True, length)
            cells = (rows.stop - rows.start) * (cols.stop - cols.start)
            work.add(cells / 2 if causal else cells)  # a causal block computes about half its cells
        assert len(work) == 1, f"step {step}: unequal work {work}"


def test_sequence_not_divisible_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ContextParallelError, match="sequence length is 66; use a sequence length that is a multiple of 8"
    ):
        shard_sequence(torch.zeros(2, 66), 4, 0, load_balanced=True)
    with pytest.raises(ContextParallelError, match="cp = 4 shards, but the sequence length is 66"):
        shard_sequence(torch.zeros(2, 66), 4, 0, load_balanced=False)


class _Attention(torch.nn.Module):
    """Attention computed by hand or by SDPA with a mask/dropout: what CP must refuse, never silently shard."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if self.how == "by_hand":
            return torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
        if self.how == "mask":
            return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("by_hand", "M.attention ran without calling F.scaled_dot_product_attention"),
        ("mask", "M.attention passes attn_mask to scaled_dot_product_attention"),
        ("dropout", "M.attention uses attention dropout_p=0.1; context parallel needs 0"),
    ],
)
def test_attention_it_cannot_split_is_refused(how: str, message: str) -> None:
    module = _Attention(how)
    _swap_attention(
        module, ContextParallelAttention(group=None, style="ring", where="M.attention")
    )  # refused before any collective
    with pytest.raises(ContextParallelError, match=message):
        module(torch.randn(1, 2, 4, 8))
