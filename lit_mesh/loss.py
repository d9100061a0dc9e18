"""Cross-entropy over a large vocabulary without its fp32 logits held whole, and without gathering them under TP.

`cross_entropy(logits, targets)` = F.cross_entropy(logits.float(), targets) (mean over the targets that are not
`ignore_index`), computed over chunks of rows: the forward keeps only each row's log-sum-exp (fp32, one number a
row) and the logits in their own dtype; the backward recomputes each chunk's softmax. Peak extra memory: one
chunk's fp32 rows, instead of the fp32 copy of the logits, the log-softmax kept for backward and its fp32 gradient.

Loss parallel: logits that are a DTensor sharded over the vocabulary (the "vocab_head" TP style keeps the head's
output so) are never gathered: each tp rank works on its vocabulary shard; the row max, the sum of exponentials
and the target's logit are all-reduced over the tp group (three all-reduces of one number a row per chunk), and
the backward needs no communication at all. Why not torch's `loss_parallel()`: its backward must run inside the
context manager, but Lightning (and the pipeline schedule) run backward elsewhere; it has no chunking either.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

CHUNK_ROWS = 1024  # rows (tokens) per chunk: 1024 x 128256 fp32 = 0.5 GB of temporaries at a time


def _all_reduce(x: Tensor, op: Any, group: Optional[dist.ProcessGroup]) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        vocab_start: int,
        group: Optional[dist.ProcessGroup],
        ignore_index: int,
        chunk_rows: int,
    ) -> Tensor:
        """logits (N, V_local): this rank's vocabulary [vocab_start, vocab_start + V_local); targets (N,)."""
        local = targets - vocab_start
        in_shard = (local >= 0) & (local < logits.shape[1])
        local = local.clamp(0, logits.shape[1] - 1)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = torch.empty_like(lse)
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)  # a view: no copy of the rows
            chunk = logits[rows].float()
            row_max = _all_reduce(chunk.max(dim=1).values, dist.ReduceOp.MAX, group)
            sum_exp = _all_reduce((chunk - row_max[:, None]).exp_().sum(dim=1), dist.ReduceOp.SUM, group)
            lse[rows] = row_max + torch.log(sum_exp)
            picked[rows] = torch.where(in_shard[rows], chunk.gather(1, local[rows, None]).squeeze(1), 0.0)
        picked = _all_reduce(picked, dist.ReduceOp.SUM, group)
        valid = targets != ignore_index
        count = valid.sum()
        loss = torch.where(valid, lse - picked, 0.0).sum() / count
        ctx.save_for_backward(logits, local, in_shard & valid, valid, lse, count)
        ctx.chunk_rows = chunk_rows
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Optional[Tensor], ...]:
        logits, local, hit, valid, lse, count = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scale = grad_loss / count
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            # one fp32 chunk, updated in place: softmax over the whole vocabulary, minus the one-hot target
            probs = logits[rows].to(torch.float32, copy=True).sub_(lse[rows, None]).exp_()
            probs.scatter_add_(1, local[rows, None], -hit[rows, None].float())
            grad[rows] = probs.mul_(scale * valid[rows, None])
            del probs  # before the next chunk's: one fp32 chunk alive at a time
        return grad, None, None, None, None, None


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, chunk_rows: int = CHUNK_ROWS) -> Tensor:
    """Mean cross-entropy of logits (..., V) against targets (...) in fp32, chunked; a DTensor sharded over the
    vocabulary (last dim) is reduced over its mesh without being gathered. Returns a plain 0-dim tensor."""
    targets = targets.reshape(-1)
    if isinstance(logits, DTensor):
        placements = logits.placements
        if len(placements) != 1 or placements[0] != Shard(logits.ndim - 1):
            logits = logits.full_tensor()  # not vocabulary-sharded: nothing to gain from its layout
        else:
            mesh = logits.device_mesh
            local = logits.to_local()
            vocab_start = mesh.get_local_rank() * local.shape[-1]  # tp divides the vocabulary (plan's tp_divides)
            return _ChunkedCrossEntropy.apply(
                local.reshape(-1, local.shape[-1]), targets, vocab_start, mesh.get_group(), ignore_index, chunk_rows
            )
    return _ChunkedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets, 0, None, ignore_index, chunk_rows)
