"""Training FLOPs per token of the zoo models, by the names callers know. Each config computes its own, with one
convention (TransformerConfig.flops_per_token: 6 x matmul weights a token passes through + 12 x layers x seq_len x
dim for attention, counted dense): the GPT's and MoE's formula is written once, in zoo.gpt.TransformerConfig (MoEConfig
replaces only the feed-forward part by the experts a token uses), the ViT's in zoo.vit.ViTConfig.
"""

from __future__ import annotations

from zoo.gpt import TransformerConfig
from zoo.vit import ViTConfig


def gpt_flops_per_token(config: TransformerConfig, seq_len: int) -> float:
    return config.flops_per_token(seq_len)


def vit_flops_per_token(config: ViTConfig) -> float:
    return config.flops_per_token()
