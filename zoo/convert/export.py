"""A trained checkpoint (sharded MeshStrategy directory or one Lightning file) -> a transformers directory
(config.json + model.safetensors) that `from_pretrained(directory)` loads.

The model configuration comes from the checkpoint's hyper-parameters: zoo GPTModule/MoEModule/ViTModule
(preset + config_overrides, converted to Llama/Mixtral/ViT) and zoo.hf modules (architecture +
config_overrides); for your own LightningModule around a transformers model pass its `config`, and around a
zoo model its zoo config (GPTConfig, MoEConfig, ViTConfig).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME

from lit_mesh.checkpoint import CheckpointError, load_full_state_dict
from lit_mesh.checkpoint.export import weights_under
from lit_mesh.checkpoint.output import check_output, written_in_place
from lit_mesh.checkpoint.safe_load import load_weights_only
from lit_mesh.extras import require
from zoo.convert.api import CONVERTERS, _load, zoo_state_to_hf
from zoo.convert.rules import ConversionError


def checkpoint_hyperparameters(checkpoint: str | Path) -> dict[str, Any]:
    path = Path(checkpoint).expanduser()
    source = path / _METADATA_FILENAME if path.is_dir() else path
    if not source.is_file():
        raise CheckpointError(
            f"cannot load checkpoint {str(path)!r}: it has no {_METADATA_FILENAME} (Lightning's part of a sharded"
            " checkpoint: its hyper-parameters), so it was not saved by Lightning; export it with `lit-mesh export`"
        )
    saved = load_weights_only(source, f"{str(source)!r}")  # never runs code from it
    hparams = saved.get("hyper_parameters") if isinstance(saved, dict) else None
    return dict(hparams) if isinstance(hparams, dict) else {}


def _zoo_kind(weights: dict[str, torch.Tensor]) -> tuple[str, type] | None:
    """(converter name, zoo config class) when the weights are a zoo GPT, MoE or ViT, else None."""
    from zoo.gpt import GPTConfig
    from zoo.moe import MoEConfig
    from zoo.vit import ViTConfig

    if any(key.endswith(".moe.router.gate.weight") for key in weights):  # before the GPT: the same embedding
        return "mixtral", MoEConfig
    if "tok_embeddings.weight" in weights or "layers.0.attention.wq.weight" in weights:
        return "llama", GPTConfig
    if "embed.pos_embed" in weights:
        return "vit", ViTConfig
    return None


def _zoo_config(
    weights: dict[str, torch.Tensor], hparams: dict[str, Any], given: Any, checkpoint: Any
) -> tuple[str, Any] | None:
    """(converter name, zoo config): the given zoo config, else the zoo module's preset + config_overrides."""
    kind = _zoo_kind(weights)
    if kind is None:
        return None
    name, config_class = kind
    if isinstance(given, config_class):
        return name, given
    if hparams.get("pretrained"):  # fine-tuned from a transformers directory: its config, as the module read it
        return name, _pretrained_config(hparams, checkpoint, lambda c: CONVERTERS[name].to_zoo_config(c))
    if "preset" not in hparams:  # not saved by a zoo module: guessing a preset would name the wrong shapes
        raise ConversionError(
            f"{str(checkpoint)!r} holds zoo {config_class.__name__.removesuffix('Config')} weights but no 'preset'"
            f" hyper-parameter (its LightningModule is not a zoo module); pass the model's config:"
            f" export_hf(checkpoint, directory, config={config_class.__name__}.from_preset(...))"
        )
    return name, config_class.from_preset(hparams["preset"], **(hparams.get("config_overrides") or {}))


def _pretrained_config(hparams: dict[str, Any], checkpoint: Any, convert: Any = None) -> Any:
    """The config of the directory a module was fine-tuned from (hparams 'pretrained'), with its overrides."""
    import dataclasses

    from transformers import AutoConfig

    directory = Path(hparams["pretrained"])
    if not (directory / "config.json").is_file():
        raise ConversionError(
            f"{str(checkpoint)!r} was fine-tuned from pretrained={str(directory)!r}, whose config.json is gone; pass"
            " the model's config: export_hf(checkpoint, directory, config=AutoConfig.from_pretrained(...))"
        )
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    overrides = hparams.get("config_overrides") or {}
    if convert is None:
        config.update(overrides)
        return config
    return dataclasses.replace(convert(config), **overrides)


def _hf_model(config: Any, weights: dict[str, torch.Tensor]) -> Any:
    transformers = require("transformers")

    auto = (
        transformers.AutoModelForCausalLM
        if "lm_head.weight" in weights
        else (
            transformers.AutoModelForImageClassification if "classifier.weight" in weights else transformers.AutoModel
        )
    )
    return _load(auto.from_config, config, weights)


def export_hf(
    checkpoint: str | Path, directory: str | Path, prefix: str = "model", config: Any = None, force: bool = False
) -> Path:
    """Write the model under `prefix` of `checkpoint` as a transformers directory; returns the directory.

    An existing `directory` is replaced (whole) only with force=True; it is written under a temporary name and
    renamed, so a failure leaves what was there."""
    out = Path(directory)
    check_output(out, Path(checkpoint), "directory", force)  # before the (long) read
    weights = weights_under(load_full_state_dict(checkpoint), prefix, checkpoint)
    hparams = checkpoint_hyperparameters(checkpoint)
    zoo = _zoo_config(weights, hparams, config, checkpoint)
    if zoo is not None:
        converter = CONVERTERS[zoo[0]]
        hf_config, hf_weights = zoo_state_to_hf(converter, weights, zoo[1])
        model = _load(converter.hf_model, hf_config, hf_weights)
    else:
        if config is None and hparams.get("pretrained"):
            config = _pretrained_config(hparams, checkpoint)
        if config is None:
            if "architecture" not in hparams:
                raise ConversionError(
                    f"{str(checkpoint)!r}: the model is neither a zoo model nor a zoo.hf module; pass its"
                    " transformers config: export_hf(checkpoint, directory, config=model.config)"
                )
            from zoo.hf.configs import ARCHITECTURES, tiny_config

            if hparams["architecture"] not in ARCHITECTURES:
                raise ConversionError(
                    f"{str(checkpoint)!r}: its hyper-parameter architecture={hparams['architecture']!r} is none"
                    f" of {list(ARCHITECTURES)}; pass its transformers config: export_hf(checkpoint, directory,"
                    " config=...)"
                )
            config = tiny_config(hparams["architecture"], **(hparams.get("config_overrides") or {}))
        model = _hf_model(config, weights)
    with written_in_place(out, "directory") as tmp:
        model.save_pretrained(tmp)
    return out


def main(argv: list[str]) -> None:
    """`lit-mesh export-hf CHECKPOINT OUTPUT` (an entry point of the group "lit_mesh.commands", pyproject.toml)."""
    parser = argparse.ArgumentParser(
        prog="lit-mesh export-hf",
        description="Write the model of a checkpoint as a transformers directory (config.json + model.safetensors)"
        " that from_pretrained loads.",
    )
    parser.add_argument("checkpoint", help="a checkpoint written by `lit-mesh fit` (sharded directory or one file)")
    parser.add_argument("output", help="the directory to write")
    parser.add_argument("--prefix", default="model", help="the LightningModule attribute holding the model")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT (the whole directory) if it exists")
    args = parser.parse_args(argv)
    from lit_mesh.cli import refusals_reported

    with refusals_reported(parser, ConversionError):
        out = export_hf(args.checkpoint, args.output, prefix=args.prefix, force=args.force)
    print(f"wrote {out}")
