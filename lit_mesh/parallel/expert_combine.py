"""The combine of expert parallel: the weighted expert outputs back to the ranks their tokens came from, summed per
token, as one operator that selective activation checkpointing does not keep.

Why one custom operator (torch.library): backward needs nothing this all-to-all returns (the sum's gradient is the
tokens' gradient, sent back the other way), so keeping its output, as selective AC keeps every all-to-all's
(lit_mesh/parallel/activation_checkpointing.py), would hold top_k x dim per token for nothing. As one operator it is
opaque to the checkpoint's policy (not among the kept ops) and to torch.compile. Nothing it saves for backward
is a saved tensor either (the token index stays on the autograd context): the checkpoint's recompute stops once
it has rebuilt the last saved tensor (torch's early stop), before this operator, so it never runs the all-to-all
again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import _functional_collectives as funcol
from torch.distributed.distributed_c10d import GroupName


def weighted_sum_per_token(
    tokens: torch.Tensor, token_index: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The combine without expert parallel (as zoo.moe.LocalDispatch): row i times weights[i], summed into token
    token_index[i] of a tensor like `tokens`."""
    return torch.zeros_like(tokens).index_add(0, token_index, rows * weights[:, None].to(rows.dtype))


@torch.library.custom_op("lit_mesh::combine_expert_outputs", mutates_args=())
def combine_expert_outputs(
    rows: torch.Tensor,
    token_index: torch.Tensor,
    n_tokens: int,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group_name: str,
) -> torch.Tensor:
    """rows (weighted expert outputs, in the order their tokens arrived) -> (n_tokens, dim): each rank's rows sent
    back to it (`input_split_sizes` to each rank, `output_split_sizes` from each), then summed into their tokens
    (`token_index`: the token of each returned row)."""
    returned = funcol.wait_tensor(
        funcol.all_to_all_single(rows.contiguous(), output_split_sizes, input_split_sizes, GroupName(group_name))
    )
    return rows.new_zeros(n_tokens, rows.shape[1]).index_add(0, token_index, returned)


@combine_expert_outputs.register_fake
def _(
    rows: torch.Tensor,
    token_index: torch.Tensor,
    n_tokens: int,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group_name: str,
) -> torch.Tensor:
    return rows.new_empty(n_tokens, rows.shape[1])


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _rows, token_index, _n_tokens, output_split_sizes, input_split_sizes, group_name = inputs
    # an attribute, not save_for_backward: a saved tensor here would make the checkpoint's recompute reach this
    # operator and run its all-to-all again (module doc); the index is an integer input, never an output
    ctx.token_index = token_index
    ctx.splits = (output_split_sizes, input_split_sizes)
    ctx.group_name = group_name


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    output_split_sizes, input_split_sizes = ctx.splits
    per_row = grad.index_select(0, ctx.token_index).contiguous()
    rows_grad = funcol.wait_tensor(
        funcol.all_to_all_single(per_row, input_split_sizes, output_split_sizes, GroupName(ctx.group_name))
    )
    return rows_grad, None, None, None, None, None


combine_expert_outputs.register_autograd(_backward, setup_context=_setup_context)
