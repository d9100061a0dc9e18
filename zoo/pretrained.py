"""Where each parameter of a model comes from in a transformers checkpoint directory (config.json and
safetensors, sharded with model.safetensors.index.json or not).

`hf_sources` maps a transformers model's own parameter names (Llama, Qwen2, Mistral, Mixtral, GPT-2);
`zoo_sources` maps a zoo GPT / MoE through the converters' renaming rules (zoo/convert). Mixtral directories
hold the hub's layout, one w1/w2/w3 per expert under `block_sparse_moe`: they are stacked (and, for the zoo
MoE, transposed) per rank, never whole. lit_mesh.checkpoint.pretrained then reads each rank's slices.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torch import nn

from lit_mesh.checkpoint.pretrained import (
    Concatenated,
    FileTensor,
    PretrainedError,
    Stacked,
    TensorSource,
    Transposed,
    check_sources,
    fill_parameters,
)
from lit_mesh.extras import require
from lit_mesh.parallel.pipeline.tied import tied_name_groups
from zoo.convert.rules import Converter

INDEX_FILE = "model.safetensors.index.json"
# the transformers classes a pretrained directory may hold, for zoo.hf.HFCausalLM
CAUSAL_LMS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "GPT2LMHeadModel")
_HUB_EXPERT = ".block_sparse_moe.experts.{e}.{w}.weight"
_EXPERTS = re.compile(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ZOO_EXPERTS = re.compile(r"^layers\.(\d+)\.moe\.experts\.(w1|w2|w3)$")


def _inside(directory: Path, name: Any) -> Path:
    """A weight_map entry of the index: a file of the directory itself, never a path leading out of it."""
    file = directory / str(name)
    if not isinstance(name, str) or Path(name).is_absolute() or directory.resolve() not in file.resolve().parents:
        raise PretrainedError(
            f"{str(directory / INDEX_FILE)!r} maps weights to {name!r}, which is not a file of {str(directory)!r};"
            " a model directory's index names its own safetensors files: re-save the model with save_pretrained"
        )
    return file


def directory_tensors(directory: str | Path) -> dict[str, FileTensor]:
    """Every tensor of the directory's safetensors files, by key (only the headers are read)."""
    safe_open = require("safetensors").safe_open
    path = Path(directory).expanduser()
    index = path / INDEX_FILE
    if index.is_file():
        files = sorted({_inside(path, f) for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PretrainedError(
            f"{str(path)!r} holds no *.safetensors file; save the model with save_pretrained(DIR) (safetensors is"
            " its default), or convert its .bin weights"
        )
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensors[key] = FileTensor(file, key, tuple(f.get_slice(key).get_shape()))
    return tensors


def read_config(directory: str | Path, allowed: tuple[str, ...]) -> Any:
    """The directory's transformers config; a directory of another architecture is refused by name."""
    from transformers import AutoConfig

    path = Path(directory).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"pretrained={str(directory)!r} has no config.json; give a directory that save_pretrained wrote"
        )
    config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)  # never its code
    architecture = (config.architectures or [type(config).__name__])[0]
    if architecture not in allowed:
        raise PretrainedError(
            f"pretrained={str(directory)!r} holds a {architecture} (model_type {config.model_type!r}); this module loads"
            f" {list(allowed)}"
        )
    return config


def _keys(source: TensorSource) -> set[str]:
    if isinstance(source, FileTensor):
        return {source.key}
    if isinstance(source, Transposed):
        return _keys(source.source)
    return set().union(*(_keys(s) for s in source.sources))  # Stacked, Concatenated


def _n_experts(tensors: dict[str, FileTensor], layer: str) -> int:
    n = 0
    while f"{layer}{_HUB_EXPERT.format(e=n, w='w1')}" in tensors:
        n += 1
    return n


def _hub_experts(
    tensors: dict[str, FileTensor], layer: str, weights: tuple[str, ...], transpose: bool
) -> TensorSource | None:
    """Per-expert hub tensors of `layer` stacked (each w in `weights` concatenated along dim 0 first)."""
    n = _n_experts(tensors, layer)
    per_expert = []
    for e in range(n):
        parts = [tensors.get(f"{layer}{_HUB_EXPERT.format(e=e, w=w)}") for w in weights]
        if any(p is None for p in parts):
            return None
        part: TensorSource = parts[0] if len(parts) == 1 else Concatenated(tuple(parts), dim=0)
        per_expert.append(Transposed(part) if transpose else part)
    return Stacked(tuple(per_expert)) if per_expert else None


def _hf_source(name: str, tensors: dict[str, FileTensor]) -> TensorSource | None:
    if name in tensors:
        return tensors[name]
    hub_name = name.replace(".mlp.", ".block_sparse_moe.")  # Mixtral's router, as the hub names it
    if hub_name in tensors:
        return tensors[hub_name]
    experts = _EXPERTS.match(name)
    if experts:  # gate_up_proj (E, 2 * hidden, dim) = [w1; w3] per expert; down_proj (E, dim, hidden) = w2
        weights = ("w1", "w3") if experts[2] == "gate_up_proj" else ("w2",)
        return _hub_experts(tensors, experts[1], weights, transpose=False)
    return None


def _sources(
    model: nn.Module, directory: str | Path, tensors: dict[str, FileTensor], resolve: Any
) -> dict[str, TensorSource]:
    sources = {}
    for name, _ in model.named_parameters():
        source = resolve(name)
        if source is not None:
            sources[name] = source
    used = set().union(*(_keys(s) for s in sources.values())) if sources else set()
    unused = sorted(set(tensors) - used - set(model.state_dict()))  # tied aliases (lm_head) are not left over
    check_sources(model, sources, unused, repr(str(directory)))
    for group in tied_name_groups(model):  # under pp the last stage holds the head's copy under the head's name
        if group[0] in sources:
            sources.update({alias: sources[group[0]] for alias in group[1:]})
    return sources


def hf_sources(model: nn.Module, directory: str | Path) -> dict[str, TensorSource]:
    """Sources for a transformers model's parameters (built on the meta device is enough), by its names."""
    tensors = directory_tensors(directory)
    return _sources(model, directory, tensors, lambda name: _hf_source(name, tensors))


def zoo_sources(model: nn.Module, directory: str | Path, converter: Converter) -> dict[str, TensorSource]:
    """Sources for a zoo GPT (from Llama) or MoE (from Mixtral) through the converter's renaming rules."""
    tensors = directory_tensors(directory)
    rules = [(rule, rule.pattern("zoo")) for rule in converter.rules]

    def resolve(name: str) -> TensorSource | None:
        experts = _ZOO_EXPERTS.match(name)
        if experts:  # zoo w1, w3 (E, dim, hidden) and w2 (E, hidden, dim): the hub's per-expert (out, in) transposed
            return _hub_experts(tensors, f"model.layers.{experts[1]}", (experts[2],), transpose=True)
        for rule, pattern in rules:
            match = pattern.match(name)
            if match:
                hf_name = rule.hf.replace("{i}", match.group(1)) if match.groups() else rule.hf
                return _hf_source(hf_name, tensors)
        return None

    return _sources(model, directory, tensors, resolve)


def prefixed(sources: dict[str, TensorSource], prefix: str) -> dict[str, TensorSource]:
    """The sources under the names the LightningModule gives the parameters (e.g. 'model.' + name)."""
    return {f"{prefix}.{name}": source for name, source in sources.items()}


class FromPretrained:
    """A mixin (first among the bases) for LightningModules whose `self.model` may start from a pretrained
    directory: set `self._sources` (parameter names of `self.model` -> sources) in __init__; after the base's
    configure_model has built the model, the whole model is read here when it is not on the meta device. Under
    MeshStrategy it still is; the strategy reads each rank's slices once it is sharded
    (lit_mesh.checkpoint.pretrained.load_pretrained calls `pretrained_sources`)."""

    _sources: dict[str, TensorSource] | None = None
    model: nn.Module | None

    def configure_model(self) -> None:
        created = self.model is None  # the hook may run more than once (fit, then test)
        super().configure_model()  # type: ignore[misc]  # the LightningModule's, after this mixin in the MRO
        self._load_if_built(created)

    def pretrained_sources(self) -> dict[str, TensorSource] | None:
        return None if self._sources is None else prefixed(self._sources, "model")

    def _load_if_built(self, created: bool) -> None:
        assert self.model is not None
        if created and self._sources is not None and not any(p.is_meta for p in self.model.parameters()):
            fill_parameters(self.model, self._sources)  # no MeshStrategy: the whole model, read here


def pretrained_zoo(
    directory: str, converter_name: str, overrides: dict[str, Any] | None
) -> tuple[Any, dict[str, TensorSource]]:
    """(zoo config, sources) of a Llama (zoo GPT) or Mixtral (zoo MoE) directory, every tensor checked."""
    import dataclasses

    from zoo.convert.api import CONVERTERS
    from zoo.convert.rules import build_on_meta

    converter = CONVERTERS[converter_name]
    architecture = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}[converter_name]
    config = dataclasses.replace(converter.to_zoo_config(read_config(directory, (architecture,))), **(overrides or {}))
    return config, zoo_sources(build_on_meta(converter.zoo_model, config), directory, converter)
