"""The machinery every conversion shares: renaming tensors by rules, reshaping where layouts differ, and
checking every tensor against the shapes the target model expects (errors name the tensor and both shapes).

A conversion is one `Converter`: the zoo class, the transformers class, the two config mappings and the
tensor rules. Adding a model pair (e.g. zoo MoE <-> Mixtral) is one more small file that builds a Converter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Reshape = Callable[[torch.Tensor, Any], torch.Tensor]  # (tensor, the target config) -> tensor


class ConversionError(ValueError):
    """A state dict that does not fit the model it is converted to, naming the tensors and the fix."""


@dataclass(frozen=True)
class Rule:
    """One tensor (or one per layer: '{i}' stands for the layer index) in both namings."""

    zoo: str
    hf: str
    to_hf: Reshape | None = None
    to_zoo: Reshape | None = None

    def pattern(self, side: str) -> re.Pattern[str]:
        template = self.zoo if side == "zoo" else self.hf
        return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


@dataclass(frozen=True)
class Converter:
    name: str
    zoo_model: Callable[[Any], nn.Module]  # zoo config -> zoo model
    hf_model: Callable[[Any], nn.Module]  # transformers config -> transformers model
    to_hf_config: Callable[[Any], Any]
    to_zoo_config: Callable[[Any], Any]
    rules: Sequence[Rule]
    # zoo tensors transformers has no counterpart for, made from the zoo config (e.g. zero register tokens)
    zoo_only: Callable[[Any], dict[str, torch.Tensor]] = lambda _config: {}
    # where transformers fuses several zoo tensors into one (Mixtral's gate_up_proj): `pack` turns a zoo state
    # dict into one with the fused tensors (still zoo names, before renaming), `unpack` undoes it (after)
    pack: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state
    unpack: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state
    # transformers may save a model in another layout than it holds it in memory (Mixtral: the hub's
    # per-expert tensors): that layout -> the in-memory one, before renaming (the in-memory one passes)
    from_checkpoint: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state


def rename(
    state: dict[str, torch.Tensor], rules: Sequence[Rule], source: str, target_config: Any
) -> dict[str, torch.Tensor]:
    """Rename (and reshape) every tensor of `state` from `source` ('zoo' or 'hf') naming to the other."""
    target = "hf" if source == "zoo" else "zoo"
    compiled = [(rule, rule.pattern(source)) for rule in rules]
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, tensor in state.items():
        for rule, pattern in compiled:
            match = pattern.match(key)
            if match:
                new_key = (
                    getattr(rule, target).replace("{i}", match.group(1)) if match.groups() else getattr(rule, target)
                )
                reshape = rule.to_hf if target == "hf" else rule.to_zoo
                out[new_key] = reshape(tensor, target_config) if reshape else tensor
                break
        else:
            unknown.append(key)
    if unknown:
        raise ConversionError(f"no {source} -> {target} rule for tensors {unknown[:5]} ({len(unknown)} in all)")
    return out


def check_against(state: dict[str, torch.Tensor], model: nn.Module, what: str, ignore: Sequence[str] = ()) -> None:
    """Every tensor the model expects is there with its shape, and nothing else; else a ConversionError."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in ignore}
    mismatched = [
        f"{k}: {tuple(state[k].shape)} given, {shape} expected"
        for k, shape in expected.items()
        if k in state and tuple(state[k].shape) != shape
    ]
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected) - set(ignore))
    if mismatched or missing or extra:
        parts = []
        if mismatched:
            parts.append(f"{len(mismatched)} tensors of another shape, e.g. " + "; ".join(mismatched[:3]))
        if missing:
            parts.append(f"missing {missing[:3]}")
        if extra:
            parts.append(f"unexpected {extra[:3]}")
        raise ConversionError(
            f"the weights do not fit {what} {type(model).__name__} ("
            + "; ".join(parts)
            + "): convert with the configuration the"
            " weights were trained with (the converters derive it: to_hf_config / to_zoo_config)"
        )


def complete_tied(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` with every name of a tied parameter of `model` (e.g. the head sharing the embedding: lm_head.weight,
    output.weight), given once is enough: transformers' files omit the alias. Two different values are an error."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    out = dict(state)
    for names in (names for names in by_id.values() if len(names) > 1):
        given = [n for n in names if n in out]
        if not given:
            continue  # reported missing by check_against
        value = out[given[0]]
        for name in given[1:]:
            other = out[name]
            if not (value.is_meta or other.is_meta or torch.equal(value.cpu(), other.cpu())):
                raise ConversionError(
                    f"{given[0]} and {name} hold different values, but the model ties them (one matrix); convert"
                    " with the untied configuration (tie_embeddings / tie_word_embeddings=False)"
                )
        out.update({name: value for name in names})
    return out


def build_on_meta(factory: Callable[[Any], nn.Module], config: Any) -> nn.Module:
    """The model's tensor names and shapes without allocating or initialising anything."""
    with torch.device("meta"):
        return factory(config)
