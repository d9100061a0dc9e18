"""Training FLOPs per token of the zoo models, from their configs (forward + backward = 3 x forward).

Matmuls count 2 FLOPs per multiply-add: 6 x (matmul parameters a token passes through); attention scores and
weighted values add 12 x layers x seq_len x (heads x head_dim), counted dense (no causal halving), the
convention of PaLM's MFU. Norms, activations, softmax and embedding lookups are left out.
"""

from __future__ import annotations

from zoo.gpt import GPTConfig
from zoo.vit import ViTConfig


def gpt_flops_per_token(config: GPTConfig, seq_len: int) -> float:
    hd = config.head_dim
    attention = config.dim * config.n_heads * hd * 2 + config.dim * config.n_kv_heads * hd * 2  # wq, wo; wk, wv
    feed_forward = 3 * config.dim * config.ffn_hidden  # w1, w2, w3
    matmul_params = config.n_layers * (attention + feed_forward) + config.dim * config.vocab_size  # + output head
    return 6.0 * matmul_params + 12.0 * config.n_layers * seq_len * config.n_heads * hd


def vit_flops_per_token(config: ViTConfig) -> float:
    s, d = config.seq_len, config.dim
    patch_embedding = config.n_patches * config.in_channels * config.patch_size**2 * d  # patch tokens only
    blocks = s * config.depth * (4 * d * d + 2 * d * config.mlp_hidden)
    head = d * config.n_classes  # once per image
    per_image = 6.0 * (patch_embedding + blocks + head) + 12.0 * config.depth * s * s * d
    return per_image / s
