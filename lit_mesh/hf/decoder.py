"""Decoder-only language models (Llama, Qwen2, Qwen3, Mistral and alike): transformers' own TP plan + SP + FSDP per
decoder layer; Llama, Qwen2, Qwen3 and Mistral also context parallel (lit_mesh/hf/context.py). Any other transformers model
gets the same derivation without context parallel (`derived_plan`)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from lit_mesh.hf.blocks import base_prefix, hf_config
from lit_mesh.hf.context import context_plan
from lit_mesh.hf.from_config import hf_tp_plan, plan_from_hf
from lit_mesh.hf.pipeline import decoder_pipeline_plan
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
    return with_decoder_stages(model, plan_from_hf(model, tp_divides(model)))


def with_decoder_stages(model: nn.Module, plan: ParallelPlan) -> ParallelPlan:
    """`plan` with pipeline stages where the causal LM has the decoder's parts by their Llama names (Qwen2,
    Mistral, Mixtral alike); unchanged otherwise (a base model has no head: no stages)."""
    base = base_prefix(model)
    if all(_has(model, name) for name in (f"{base}embed_tokens", f"{base}norm", f"{base}rotary_emb", "lm_head")):
        return replace(plan, pp=decoder_pipeline_plan(base, ("embed_tokens",), "norm"))
    return plan


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def llama_family_plan(model: nn.Module) -> ParallelPlan:
    """Llama, Qwen2, Qwen3, Mistral: the decoder plan and context parallel through transformers' attention
    registry."""
    return replace(decoder_plan(model), cp=context_plan(model))


derived_plan = decoder_plan
