"""zoo ViT <-> transformers ViTForImageClassification. The same maths when the zoo ViT has no register
tokens: [class, patches] + position embeddings, pre-norm blocks, exact GELU, the class token classified.
The zoo's patch projection is a Linear over (C, p, p)-flattened patches: Conv2d's weight reshaped."""

from __future__ import annotations

from typing import Any

import torch

from lit_mesh.extras import require
from zoo.convert.rules import Converter, Rule
from zoo.vit import ViT, ViTConfig


def to_vit_hf_config(c: ViTConfig) -> Any:
    HFViTConfig = require("transformers").ViTConfig

    if c.n_registers:
        raise ValueError(
            f"zoo ViT with n_registers={c.n_registers}: transformers' ViT has no register tokens; convert a zoo"
            " ViT built with n_registers=0"
        )
    return HFViTConfig(
        image_size=c.image_size,
        patch_size=c.patch_size,
        num_channels=c.in_channels,
        num_labels=c.n_classes,
        hidden_size=c.dim,
        num_hidden_layers=c.depth,
        num_attention_heads=c.n_heads,
        intermediate_size=c.mlp_hidden,
        layer_norm_eps=c.norm_eps,
        hidden_act="gelu",
        qkv_bias=True,
    )


def to_vit_zoo_config(c: Any) -> ViTConfig:
    if (
        c.hidden_act != "gelu"
        or not c.qkv_bias
        or not isinstance(c.image_size, int)
        or not isinstance(c.patch_size, int)
    ):
        raise ValueError(
            f"ViTConfig with hidden_act={c.hidden_act!r}, qkv_bias={c.qkv_bias}, image_size={c.image_size},"
            f" patch_size={c.patch_size}: the zoo ViT has exact GELU, q/k/v biases and square int sizes"
        )
    return ViTConfig(
        image_size=c.image_size,
        patch_size=c.patch_size,
        in_channels=c.num_channels,
        n_classes=c.num_labels,
        dim=c.hidden_size,
        depth=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        mlp_hidden=c.intermediate_size,
        n_registers=0,
        norm_eps=c.layer_norm_eps,
    )


def _vit(config: Any) -> Any:
    ViTForImageClassification = require("transformers").ViTForImageClassification

    return ViTForImageClassification(config)


def _patch_to_conv(weight: torch.Tensor, c: Any) -> torch.Tensor:  # (dim, C*p*p) -> (dim, C, p, p)
    return weight.reshape(c.hidden_size, c.num_channels, c.patch_size, c.patch_size)


def _conv_to_patch(weight: torch.Tensor, _c: ViTConfig) -> torch.Tensor:
    return weight.flatten(1)


def _no_registers(c: ViTConfig) -> dict[str, torch.Tensor]:
    return {"embed.registers": torch.zeros(1, 0, c.dim)}  # the zoo keeps a (1, 0, dim) tensor for none


_LAYER = [
    ("norm1", "layernorm_before"),
    ("attn.q", "attention.q_proj"),
    ("attn.k", "attention.k_proj"),
    ("attn.v", "attention.v_proj"),
    ("attn.proj", "attention.o_proj"),
    ("norm2", "layernorm_after"),
    ("mlp.fc1", "mlp.fc1"),
    ("mlp.fc2", "mlp.fc2"),
]

VIT = Converter(
    name="vit",
    zoo_model=ViT,
    hf_model=_vit,
    to_hf_config=to_vit_hf_config,
    to_zoo_config=to_vit_zoo_config,
    zoo_only=_no_registers,
    rules=[
        Rule("embed.cls_token", "vit.embeddings.cls_token"),
        Rule("embed.pos_embed", "vit.embeddings.position_embeddings"),
        Rule("embed.proj.weight", "vit.embeddings.patch_embeddings.projection.weight", _patch_to_conv, _conv_to_patch),
        Rule("embed.proj.bias", "vit.embeddings.patch_embeddings.projection.bias"),
        *(
            Rule(f"blocks.{{i}}.{zoo}.{p}", f"vit.layers.{{i}}.{hf}.{p}")
            for zoo, hf in _LAYER
            for p in ("weight", "bias")
        ),
        Rule("norm.weight", "vit.layernorm.weight"),
        Rule("norm.bias", "vit.layernorm.bias"),
        Rule("head.weight", "classifier.weight"),
        Rule("head.bias", "classifier.bias"),
    ],
)
