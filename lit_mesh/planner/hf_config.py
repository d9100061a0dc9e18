"""A transformers config.json read as a planner family's shape: `lit-mesh plan --hf-config DIR_OR_FILE`.

The Llama-family decoders (Llama, Qwen2, Mistral) have the zoo GPT's shape (RoPE, RMSNorm, grouped-query attention,
a SwiGLU feed-forward), and Mixtral the zoo MoE's (every layer MoE, softmax top-k routing renormalised over the
chosen experts, no shared expert): the planner counts their parameters, bytes and FLOPs with those families. Read
with json: no transformers import, no network. What the zoo shapes leave out: Qwen2's q/k/v biases (a few thousand
parameters per layer) and attention_bias / mlp_bias if set; nothing the memory or time terms would feel.

GPT-2 is refused: learned position embeddings, LayerNorm and a two-matrix GELU feed-forward are not the zoo GPT's
shape, and planning it as one would count a third of its feed-forward weights too many.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# model_type -> the planner family whose shape it has
FAMILY_OF_MODEL_TYPE = {"llama": "gpt", "qwen2": "gpt", "mistral": "gpt", "mixtral": "moe"}
# config.json key -> the zoo config field (both families)
SHAPE_KEYS = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_seq_len",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "ffn_hidden",
}
# Mixtral's routing -> zoo MoE fields
MOE_KEYS = {"num_local_experts": "n_experts", "num_experts_per_tok": "top_k", "intermediate_size": "expert_hidden"}
# routing that Mixtral fixes and the zoo MoE makes a choice (its MoEConfig fields)
MIXTRAL_ROUTING = {
    "n_shared_experts": 0,
    "moe_every": 1,
    "score_func": "softmax",
    "normalize_top_k": True,
    "capacity_factor": None,
    "bias_update_rate": 0.0,
}
CONFIG_FILE = "config.json"


def config_file(path: str | Path) -> Path:
    """`path` itself when it is a file, else `path`/config.json."""
    path = Path(path)
    found = path / CONFIG_FILE if path.is_dir() else path
    if not found.is_file():
        raise ValueError(
            f"--hf-config {str(path)!r}: no such file{' (a directory without config.json)' if path.is_dir() else ''};"
            " give a transformers model directory holding config.json, or the config.json itself"
        )
    return found


def read_hf_config(path: str | Path) -> tuple[str, dict[str, Any], str]:
    """(planner family name, its config fields, model_type) of the transformers config at `path`; a ValueError
    naming the value and the fix for a config it does not cover."""
    file = config_file(path)
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--hf-config {str(file)!r} is not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--hf-config {str(file)!r} holds {type(raw).__name__}, not a transformers config object")
    model_type = raw.get("model_type")
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise ValueError(
            f"--hf-config {str(file)!r}: model_type {model_type!r} is not planned; lit-mesh plan reads"
            f" {', '.join(sorted(FAMILY_OF_MODEL_TYPE))} configs (the zoo gpt and moe shapes). Plan another"
            " decoder with --model gpt and --config-overrides of its shape, where its layers are Llama-like"
        )
    fields: dict[str, Any] = {field: _integer(raw, key, file) for key, field in SHAPE_KEYS.items()}
    kv_heads = raw.get("num_key_value_heads")  # absent or null: one per head, as transformers reads it
    fields["n_kv_heads"] = fields["n_heads"] if kv_heads is None else _integer(raw, "num_key_value_heads", file)
    head_dim = raw.get("head_dim")
    if head_dim is not None and head_dim * fields["n_heads"] != fields["dim"]:
        raise ValueError(
            f"--hf-config {str(file)!r}: head_dim={head_dim} is not hidden_size / num_attention_heads"
            f" ({fields['dim']} / {fields['n_heads']}); the planner's shapes derive head_dim from them, so this"
            " model is not planned"
        )
    fields["max_seq_len"] = _integer(raw, "max_position_embeddings", file)
    if "rms_norm_eps" in raw:
        fields["norm_eps"] = float(raw["rms_norm_eps"])
    rope = raw.get("rope_parameters") or {}  # transformers 5; older files keep rope_theta at the top
    theta = rope.get("rope_theta", raw.get("rope_theta")) if isinstance(rope, dict) else raw.get("rope_theta")
    if theta is not None:
        fields["rope_theta"] = float(theta)
    tied = bool(raw.get("tie_word_embeddings", False))  # False: transformers' default for these four
    family = FAMILY_OF_MODEL_TYPE[model_type]
    if family == "gpt":
        fields["tie_embeddings"] = tied
        return family, fields, model_type
    if tied:
        raise ValueError(
            f"--hf-config {str(file)!r}: a Mixtral with tie_word_embeddings=true is not planned (the zoo MoE has"
            " no tied head); set it to false in a copy to plan the untied model"
        )
    fields.update({field: _integer(raw, key, file) for key, field in MOE_KEYS.items()})
    fields["aux_loss_coef"] = float(raw.get("router_aux_loss_coef", 0.0)) if raw.get("output_router_logits") else 0.0
    return family, {**fields, **MIXTRAL_ROUTING}, model_type


def _integer(raw: dict[str, Any], key: str, file: Path) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"--hf-config {str(file)!r}: {key}={value!r}; the planner needs it as a whole number >= 1 (every"
            " config transformers saves has it)"
        )
    return value
