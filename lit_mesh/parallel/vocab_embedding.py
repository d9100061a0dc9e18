"""A tp-sharded embedding whose backward computes only this rank's vocabulary rows.

torch's RowwiseParallel shards an nn.Embedding's rows (the vocabulary) over tp, but DTensor's embedding backward
gathers the output gradient and computes the whole vocabulary's weight gradient on every tp rank (Replicate): tp
times the shard's gradient memory and compute, held through a pipeline schedule, and only cut to the shard when FSDP
reduces it. Our own lookup (what Megatron-LM's VocabParallelEmbedding does) on the weight's local rows: tokens of
other ranks' rows read row 0 and are zeroed, the partial outputs are summed by the same collective RowwiseParallel
uses (reduce-scatter over the sequence, or all-reduce), and backward scatters the gathered output gradient into
this rank's rows only: a Shard(0) gradient, the parameter's own placement. Forward values and gradient rows are
those of torch's style, bit for bit (only one rank's term of each sum is non-zero).
"""

from __future__ import annotations

from types import MethodType

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import RowwiseParallel


def looks_up_locally(module: nn.Module) -> bool:
    """An nn.Embedding whose forward is nn.Embedding's and that uses none of the options a local lookup would
    change (max_norm renormalises rows in place, scale_grad_by_freq counts the whole batch, sparse gradients):
    any other embedding keeps torch's lookup."""
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    )


def _lookup_local_rows(self: nn.Embedding, tokens: DTensor) -> DTensor:
    """This rank's rows of the lookup, as a Partial DTensor (RowwiseParallel's output hook sums them)."""
    weight = self.weight
    assert isinstance(weight, DTensor) and isinstance(tokens, DTensor)
    # the tokens' mesh (RowwiseParallel's input hook made it): equal to the weight's, which after fake worlds of
    # one process (the planner's steps) can be an earlier world's, handed back by torch's sharding cache
    mesh = tokens.device_mesh
    local_weight = weight.to_local()  # its backward makes the local gradient a Shard(0) DTensor
    rows = local_weight.shape[0]
    coordinate = mesh.get_coordinate()  # this rank's place on the mesh, read without resolving a process group
    assert coordinate is not None, "a rank outside the embedding's mesh"
    start = coordinate[0] * -(-self.num_embeddings // mesh.size())  # torch.chunk's split, as Shard(0)'s
    ids = tokens.to_local() - start
    outside = (ids < 0) | (ids >= rows)
    padding = self.padding_idx
    local_padding = padding - start if padding is not None and 0 <= padding - start < rows else None
    out = F.embedding(ids.masked_fill(outside, 0), local_weight, local_padding)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


class VocabShardedEmbedding(RowwiseParallel):
    """RowwiseParallel for an embedding (input tokens Replicate), looking up this rank's rows on local tensors."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:  # noqa: ANN001 - torch's signature
        local = looks_up_locally(module)
        module = super()._apply(module, device_mesh)
        if local:
            # the instance's forward: RowwiseParallel's input and output hooks still run around it
            module.forward = MethodType(_lookup_local_rows, module)
        return module
