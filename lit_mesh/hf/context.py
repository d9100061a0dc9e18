"""Context parallel for transformers decoders (Llama, Qwen2, Mistral): their attention, chosen by name.

transformers' attention layers call the function that `config._attn_implementation` names in its attention
registry (`AttentionInterface`). Context parallel registers one of its own, `ATTENTION`, and names it in the
config: each layer's call then goes to the ContextParallelAttention that lit_mesh/parallel/context/apply.py made for
that layer (ring, Ulysses or all-gather over the cp ranks). No module is patched. transformers makes no mask for
a name outside its mask registry, so none is built for the rank's shard; a mask the user passes is refused.

Positions: the plan's `position_ids` get each rank's global positions (rotary embeddings see the true ones).
Labels: `model(input_ids=x, labels=y)` shifts y by one inside the rank's shard, where the next token of a shard's
last one lives on another rank. The forward pre-hook gathers the labels over cp, shifts the whole sequence, and
passes this rank's part as `shift_labels`, with `num_items_in_batch` such that the cp ranks' losses average to the
loss over the whole sequence (the -100 after the last token falls on one rank only).

What cannot be sharded is refused by name (`context_problem`, at setup through the plan; at the call for what only
the call knows): an attention other than SDPA or eager (flex, flash), a padding mask, a sliding window shorter than
the sequence, attention dropout.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.distributed import _functional_collectives as funcol

from lit_mesh.errors import ContextParallelError
from lit_mesh.hf.blocks import hf_config
from lit_mesh.parallel.context import ContextParallelAttention, is_load_balanced, shard_sequence, unshard_sequence
from lit_mesh.plan import ContextPlan

ATTENTION = "lit_mesh_context_parallel"  # our name in transformers' attention registry
SHARDABLE = ("sdpa", "eager")  # causal softmax attention without a mask: what the cp styles compute
FAMILIES = ("Llama", "Qwen2", "Qwen3", "Mistral")  # model classes whose attention layers call the registry
IGNORE_INDEX = -100  # transformers' label for "no loss here"

# attention module -> the cp attention apply_context_parallel made for it
_ATTENDS: weakref.WeakKeyDictionary[nn.Module, ContextParallelAttention] = weakref.WeakKeyDictionary()


def context_problem(model: nn.Module) -> str:
    """Why `model`'s attention cannot be split over cp ranks ("" : it can)."""
    name = type(model).__name__
    implementation = hf_config(model)._attn_implementation
    if implementation not in (*SHARDABLE, ATTENTION):
        return (
            f"{name} computes attention with attn_implementation={implementation!r}, which context parallel cannot"
            f" split over the sequence (it shards causal attention without a mask: {' or '.join(SHARDABLE)});"
            f" build the model with attn_implementation='sdpa', or use cp=1"
        )
    return ""


def context_plan(model: nn.Module) -> ContextPlan:
    """CP for a Llama-family decoder: every layer's `self_attn` goes through the registry to the cp style."""
    return ContextPlan(
        attention="self_attn",
        positions="position_ids",
        swap=use_context_parallel_attention,
        positions_batched=True,
        unavailable=context_problem(model),
    )


def not_offered(model_name: str) -> ContextPlan:
    return ContextPlan(
        unavailable=(
            f"context parallel is offered for the transformers families {', '.join(FAMILIES)}, not for {model_name};"
            " use cp=1"
        )
    )


def context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    **_kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: q (B, H, T/cp, D), k/v (B, H_kv, T/cp, D) -> ((B, T/cp, H, D),
    no weights)."""
    mode = _ATTENDS.get(module)
    if mode is None:
        raise ContextParallelError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION!r}, which only MeshStrategy's context"
            " parallel sets up; use 'sdpa' outside it"
        )
    length = query.shape[2] * mode.cp
    if sliding_window is not None and sliding_window < length:
        raise ContextParallelError(
            f"{mode.where} attends over a sliding window of {sliding_window} tokens, shorter than the sequence"
            f" ({length}); context parallel shards full causal attention: use sequences of at most {sliding_window}"
            " tokens, a config with sliding_window=None, or cp=1"
        )
    if attention_mask is not None:
        raise ContextParallelError(_mask_refused(mode.where))
    out = mode.attend(query, key, value, None, dropout, bool(getattr(module, "is_causal", True)), scaling)
    return out.transpose(1, 2).contiguous(), None


def _mask_refused(where: str) -> str:
    return (
        f"{where} got an attention mask (padding, or a mask built by the caller); context parallel computes causal"
        " attention over whole sequences: pack the batch without padding and pass no attention_mask, or use cp=1"
    )


def use_context_parallel_attention(model: nn.Module, attends: Mapping[nn.Module, ContextParallelAttention]) -> None:
    """ContextPlan.swap of a transformers decoder: its layers' attention through the registry to `attends`, its
    labels shifted over the whole sequence."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_parallel_attention)
    _ATTENDS.update(attends)
    hf_config(model)._attn_implementation = ATTENTION
    if attends:
        mode = next(iter(attends.values()))
        model.register_forward_pre_hook(_inputs_hook(mode), with_kwargs=True)


def global_shift(labels: Tensor, mode: ContextParallelAttention) -> tuple[Tensor, Tensor]:
    """This rank's part of the labels shifted by one over the whole sequence, and the number of labels that count
    (not IGNORE_INDEX) over the whole sequence. labels: (B, T/cp), this rank's shard."""
    cp, rank, balanced = mode.cp, torch.distributed.get_rank(mode.group), is_load_balanced(mode.style)
    parts = funcol.wait_tensor(funcol.all_gather_single(labels.contiguous(), 0, mode.group))
    whole = unshard_sequence(list(parts.chunk(cp, dim=0)), balanced)
    shifted = torch.nn.functional.pad(whole[:, 1:], (0, 1), value=IGNORE_INDEX)
    return shard_sequence(shifted, cp, rank, balanced), (shifted != IGNORE_INDEX).sum()


def _inputs_hook(mode: ContextParallelAttention) -> Any:
    def refuse_masks_shift_labels(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("attention_mask") is not None:  # transformers drops it for an attention outside its masks
            raise ContextParallelError(_mask_refused(f"{type(model).__name__}(attention_mask=...)"))
        labels = kwargs.get("labels")
        if labels is None or kwargs.get("shift_labels") is not None:
            return args, kwargs
        shift_labels, count = global_shift(labels, mode)
        # each rank's loss: its sum / (count / cp); Lightning's gradient mean over cp then gives sum / count
        given = kwargs.get("num_items_in_batch")
        items = count if given is None else given
        return args, {**kwargs, "shift_labels": shift_labels, "num_items_in_batch": items / mode.cp}

    return refuse_masks_shift_labels
