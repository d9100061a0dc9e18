"""Convert zoo models to transformers models and back, and write/read transformers directories
(config.json + model.safetensors) that `from_pretrained` loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_mesh.extras import require
from lit_mesh.init import retie, tied_parameters
from zoo.convert.llama import LLAMA
from zoo.convert.mixtral import MIXTRAL
from zoo.convert.rules import ConversionError, Converter, build_on_meta, check_against, complete_tied, rename
from zoo.convert.vit import VIT

CONVERTERS: dict[str, Converter] = {c.name: c for c in (LLAMA, MIXTRAL, VIT)}
# which converter a class takes: zoo class name or transformers class name
_BY_CLASS = {
    "GPT": "llama",
    "LlamaForCausalLM": "llama",
    "MoETransformer": "mixtral",
    "MixtralForCausalLM": "mixtral",
    "ViT": "vit",
    "ViTForImageClassification": "vit",
}


def converter_for(model: nn.Module) -> Converter:
    name = _BY_CLASS.get(type(model).__name__)
    if name is None:
        raise ConversionError(f"no conversion for {type(model).__name__}; converters: {sorted(_BY_CLASS)}")
    return CONVERTERS[name]


def zoo_state_to_hf(
    converter: Converter, state: dict[str, torch.Tensor], zoo_config: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(transformers config, state dict) of a zoo model's weights; shapes checked against that config."""
    hf_config = converter.to_hf_config(zoo_config)
    extra = converter.zoo_only(zoo_config)
    for key, expected in extra.items():  # transformers cannot hold them: they must be what it implies
        given = state.get(key)
        if given is None or given.is_meta:
            continue
        if not (given.shape == expected.shape and torch.equal(given.cpu(), expected)):
            raise ConversionError(
                f"{key} holds values the transformers model has no place for (it implies {expected.tolist()}"
                f" of shape {tuple(expected.shape)}); convert a model trained without them"
            )
    state = converter.pack({k: v for k, v in state.items() if k not in extra})
    hf_model = build_on_meta(converter.hf_model, hf_config)
    hf_state = complete_tied(rename(state, converter.rules, "zoo", hf_config), hf_model)
    check_against(hf_state, hf_model, "the transformers model")
    return hf_config, hf_state


def hf_state_to_zoo(
    converter: Converter, state: dict[str, torch.Tensor], hf_config: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """(zoo config, state dict) of a transformers model's weights; shapes checked against that config."""
    zoo_config = converter.to_zoo_config(hf_config)
    renamed = rename(converter.from_checkpoint(state), converter.rules, "hf", hf_config)
    zoo_model = build_on_meta(converter.zoo_model, zoo_config)
    zoo_state = complete_tied({**converter.unpack(renamed), **converter.zoo_only(zoo_config)}, zoo_model)
    check_against(zoo_state, zoo_model, "the zoo model")
    return zoo_config, zoo_state


def zoo_to_hf(model: nn.Module) -> nn.Module:
    """A transformers model with the zoo model's weights (eval mode, on the CPU)."""
    converter = converter_for(model)
    hf_config, state = zoo_state_to_hf(converter, model.state_dict(), model.config)
    return _load(converter.hf_model, hf_config, state)


def hf_to_zoo(model: nn.Module) -> nn.Module:
    """A zoo model with the transformers model's weights (eval mode, on the CPU)."""
    converter = converter_for(model)
    zoo_config, state = hf_state_to_zoo(converter, model.state_dict(), model.config)
    return _load(converter.zoo_model, zoo_config, state)


def _load(factory: Any, config: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    with torch.device("meta"):
        model = factory(config)
    tied = tied_parameters(model)
    # copies: the converted model never shares storage with the source
    model.load_state_dict({k: v.detach().cpu().clone() for k, v in state.items()}, strict=True, assign=True)
    retie(tied, type(model).__name__)  # assign=True gave each use of a tied weight its own copy
    _rebuild_buffers(model)
    return model.eval()


def _rebuild_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary frequencies) are not in a state dict: transformers computes them."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if init is None:
                raise ConversionError(f"{type(module).__name__} has meta buffers and no way to compute them")
            module.to_empty(device="cpu", recurse=False)
            init(module)


def save_hf(model: nn.Module, directory: str | Path) -> Path:
    """Write a zoo model as a transformers directory (config.json + model.safetensors)."""
    out = Path(directory)
    zoo_to_hf(model).save_pretrained(out)
    return out


def load_hf_as_zoo(directory: str | Path) -> nn.Module:
    """Read a transformers directory (config.json + *.safetensors) into the matching zoo model. transformers
    loads it first: the hub's tensor names (e.g. ViT's `encoder.layer.N.attention.attention.key`, Mixtral's
    per-expert weights) differ from its modules' names in memory, and it alone knows the mapping."""
    transformers = require("transformers")
    AutoConfig = transformers.AutoConfig

    path = Path(directory)
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{str(path)!r} holds no *.safetensors file")
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    arch = (config.architectures or [None])[0]
    if arch not in _BY_CLASS:
        raise ConversionError(f"{str(path)!r} holds a {arch}; converters: {sorted(_BY_CLASS)}")
    return hf_to_zoo(getattr(transformers, arch).from_pretrained(path))  # a class of ours: no remote code
