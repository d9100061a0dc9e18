"""Tiny transformers configs by architecture, built locally (no hub download), dropout off (numerics are
compared across mesh layouts, and dropout draws per rank)."""

from __future__ import annotations

from typing import Any

from lit_mesh.extras import require

# the Llama-style decoders' shared shape: 2 layers of 64, 4 heads (2 K/V)
_DECODER: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", _DECODER),
    "qwen2": ("Qwen2Config", _DECODER),
    # heads of 32 on a hidden size of 64 (4 x 32 = 128: Qwen3 sets head_dim so), q_norm / k_norm over each head
    "qwen3": ("Qwen3Config", {**_DECODER, "head_dim": 32}),
    "mistral": ("MistralConfig", _DECODER),
    "mixtral": (
        "MixtralConfig",
        {**_DECODER, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # every layer MoE (lit-mesh's plan for it), q/k norms over each head, the chosen experts' weights renormalised
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            **_DECODER,
            "intermediate_size": 64,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        },
    ),
    "gpt2": (
        "GPT2Config",
        dict(
            vocab_size=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    ),
    # no tensor-parallel plan known (transformers ships none): FSDP only, tp > 1 is refused by name
    "opt": (
        "OPTConfig",
        dict(
            vocab_size=256,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=256,
            dropout=0.0,
        ),
    ),
    "vit": (
        "ViTConfig",
        dict(
            image_size=8,
            patch_size=2,
            num_channels=1,
            num_labels=10,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
        ),
    ),
}
ARCHITECTURES = tuple(_TINY)


def tiny_config(architecture: str, **overrides: Any) -> Any:
    """A small transformers config of `architecture` (one of ARCHITECTURES), with `overrides` applied."""
    if architecture not in _TINY:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {list(ARCHITECTURES)}")
    transformers = require("transformers")

    class_name, fields = _TINY[architecture]
    return getattr(transformers, class_name)(**{**fields, **overrides})
