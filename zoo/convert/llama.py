"""zoo GPT <-> transformers LlamaForCausalLM. The same maths: RMSNorm, rotate-half RoPE (no q/k
permutation needed), grouped-query attention with consecutive query heads per kv head, SwiGLU."""

from __future__ import annotations

from typing import Any

import torch

from lit_mesh.extras import require
from zoo.convert.rules import Converter, Rule
from zoo.gpt import GPT, GPTConfig


def to_llama_config(c: GPTConfig) -> Any:
    LlamaConfig = require("transformers").LlamaConfig

    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_hidden,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.attention_head_dim,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_seq_len,
        hidden_act="silu",
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )


def to_gpt_config(c: Any) -> GPTConfig:
    rope = c.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" or c.hidden_act != "silu" or c.attention_bias or c.mlp_bias:
        raise ValueError(
            f"{type(c).__name__} with rope_type={rope.get('rope_type')!r}, hidden_act={c.hidden_act!r},"
            f" attention_bias={c.attention_bias}, mlp_bias={c.mlp_bias}: the zoo GPT has default RoPE, SiLU and no"
            " biases; convert a Llama config with those"
        )
    return GPTConfig(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        ffn_hidden=c.intermediate_size,
        norm_eps=c.rms_norm_eps,
        rope_theta=rope.get("rope_theta", 10000.0),
        max_seq_len=c.max_position_embeddings,
        tie_embeddings=bool(c.tie_word_embeddings),
        head_dim=explicit_head_dim(c.head_dim, c.hidden_size, c.num_attention_heads),
    )


def explicit_head_dim(head_dim: int | None, hidden_size: int, heads: int) -> int | None:
    """A transformers head_dim as the zoo config keeps it: None where it is hidden_size / heads (the zoo's
    default), else the width itself (Mistral-Nemo, Qwen3)."""
    return None if head_dim is None or head_dim * heads == hidden_size else head_dim


def _llama(config: Any) -> Any:
    LlamaForCausalLM = require("transformers").LlamaForCausalLM

    return LlamaForCausalLM(config)


# (zoo, transformers) names inside a decoder layer; Mixtral's layers share the attention half
ATTENTION_LAYER = [
    ("attention_norm.weight", "input_layernorm.weight"),
    ("attention.wq.weight", "self_attn.q_proj.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
]
_LAYER = [
    *ATTENTION_LAYER,
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
]


def _split_fused_w13(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPT with fused_w13=True: its (2 * hidden, dim) w13 -> w1 (first half of the rows) and w3."""
    out = {}
    for key, tensor in state.items():
        if key.endswith("feed_forward.w13.weight"):
            prefix = key[: -len("w13.weight")]
            out[prefix + "w1.weight"], out[prefix + "w3.weight"] = tensor.chunk(2, dim=0)
        else:
            out[key] = tensor
    return out


LLAMA = Converter(
    name="llama",
    zoo_model=GPT,
    hf_model=_llama,
    to_hf_config=to_llama_config,
    to_zoo_config=to_gpt_config,
    rules=[
        Rule("tok_embeddings.weight", "model.embed_tokens.weight"),
        *(Rule(f"layers.{{i}}.{zoo}", f"model.layers.{{i}}.{hf}") for zoo, hf in _LAYER),
        Rule("norm.weight", "model.norm.weight"),
        Rule("output.weight", "lm_head.weight"),
    ],
    pack=_split_fused_w13,  # transformers -> zoo gives fused_w13=False (the config carries no such choice)
)
