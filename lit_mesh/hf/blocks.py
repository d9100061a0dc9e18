"""Where a transformers model keeps its repeated blocks: the ModuleList of its `_no_split_modules` classes."""

from __future__ import annotations

from typing import Any

from torch import nn


def find_blocks(model: nn.Module) -> str | None:
    """Dotted path of the ModuleList whose children are the model's no-split layers (its decoder/encoder
    layers: what transformers itself never splits across devices), or None when there is none."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(type(m).__name__ in layer_classes for m in module):
            return name
    return None


def base_prefix(model: nn.Module) -> str:
    """'model.' for LlamaForCausalLM (its base model lives under `model`), '' for the base model itself."""
    prefix = getattr(model, "base_model_prefix", "")
    return f"{prefix}." if prefix and hasattr(model, prefix) else ""


def hf_config(model: nn.Module) -> Any:
    """The model's transformers config: its fields depend on the model family (typed Any, as transformers' own
    PretrainedConfig holds them as dynamic attributes)."""
    return model.config
