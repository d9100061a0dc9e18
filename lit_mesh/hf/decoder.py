"""Decoder-only language models (Llama, Qwen2, Mistral and alike): transformers' own TP plan + SP + FSDP per
decoder layer; Llama, Qwen2 and Mistral also context parallel (lit_mesh/hf/context.py). Any other transformers model
gets the same derivation without context parallel (`derived_plan`)."""

from __future__ import annotations

import dataclasses

from torch import nn

from lit_mesh.hf.blocks import hf_config
from lit_mesh.hf.context import context_plan
from lit_mesh.hf.from_config import hf_tp_plan, plan_from_hf
from lit_mesh.plan import ParallelPlan

# config fields that the tp degree must divide when the linears they size are split
_DIVIDES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
_VOCAB_SPLIT = ("colwise_gather_output", "embedding_rowwise")


def tp_divides(model: nn.Module) -> dict[str, int]:
    config = hf_config(model)
    sizes = {name: getattr(config, name) for name in _DIVIDES if isinstance(getattr(config, name, None), int)}
    if any(style in _VOCAB_SPLIT for style in hf_tp_plan(model).values()):
        sizes["vocab_size"] = config.vocab_size
    return sizes


def decoder_plan(model: nn.Module) -> ParallelPlan:
    return plan_from_hf(model, tp_divides(model))


def llama_family_plan(model: nn.Module) -> ParallelPlan:
    """Llama, Qwen2, Mistral: the decoder plan and context parallel through transformers' attention registry."""
    return dataclasses.replace(decoder_plan(model), cp=context_plan(model))


derived_plan = decoder_plan
