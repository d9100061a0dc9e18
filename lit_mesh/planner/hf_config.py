"""A transformers config.json read as a planner family's shape: `lit-mesh plan --hf-config DIR_OR_FILE`.

The Llama-family decoders (Llama, Qwen2, Qwen3, Mistral) have the zoo GPT's shape (RoPE, RMSNorm, grouped-query
attention, a SwiGLU feed-forward; heads of `head_dim` where it is not hidden_size / heads), and Mixtral and Qwen3-MoE
the zoo MoE's (softmax top-k routing, no shared expert; Mixtral's every layer MoE and renormalised, Qwen3-MoE's as
its decoder_sparse_step and norm_topk_prob say): the planner counts their parameters, bytes and FLOPs with those
families. Read with json: no transformers import, no network. What the zoo shapes leave out: Qwen2's q/k/v biases
and Qwen3's QK-norm weights (a few thousand parameters per layer) and attention_bias / mlp_bias if set; nothing
the memory or time terms would feel.

GPT-2 is refused: learned position embeddings, LayerNorm and a two-matrix GELU feed-forward are not the zoo GPT's
shape, and planning it as one would count a third of its feed-forward weights too many.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# model_type -> the planner family whose shape it has
FAMILY_OF_MODEL_TYPE = {
    "llama": "gpt",
    "qwen2": "gpt",
    "qwen3": "gpt",
    "mistral": "gpt",
    "mixtral": "moe",
    "qwen3_moe": "moe",
}
# config.json key -> the zoo config field (both families)
SHAPE_KEYS = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_seq_len",
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "intermediate_size": "ffn_hidden",
}
# each MoE model_type's routing keys -> zoo MoE fields
MOE_KEYS = {
    "mixtral": {"num_local_experts": "n_experts", "num_experts_per_tok": "top_k", "intermediate_size": "expert_hidden"},
    "qwen3_moe": {"num_experts": "n_experts", "num_experts_per_tok": "top_k", "moe_intermediate_size": "expert_hidden"},
}
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
    if raw.get("head_dim") is not None:  # absent or null: hidden_size / num_attention_heads
        head_dim = _integer(raw, "head_dim", file)
        if head_dim * fields["n_heads"] != fields["dim"]:  # heads of another width (Mistral-Nemo, Qwen3)
            fields["head_dim"] = head_dim
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
            f"--hf-config {str(file)!r}: a {model_type} with tie_word_embeddings=true is not planned (the zoo MoE has"
            " no tied head); set it to false in a copy to plan the untied model"
        )
    keys = MOE_KEYS[model_type]
    if model_type == "qwen3_moe" and "num_experts" not in raw:  # transformers 5 saves it under Mixtral's name
        keys = {("num_local_experts" if key == "num_experts" else key): field for key, field in keys.items()}
    fields.update({field: _integer(raw, key, file) for key, field in keys.items()})
    fields["aux_loss_coef"] = float(raw.get("router_aux_loss_coef", 0.0)) if raw.get("output_router_logits") else 0.0
    if model_type == "qwen3_moe":
        return family, {**fields, **_qwen3_moe_routing(raw, file)}, model_type
    return family, {**fields, **MIXTRAL_ROUTING}, model_type


def _qwen3_moe_routing(raw: dict[str, Any], file: Path) -> dict[str, Any]:
    """Qwen3-MoE's routing as zoo MoE fields: Mixtral's but for its own choices of which layers are MoE (layer i when
    (i + 1) % decoder_sparse_step == 0, the zoo's moe_every) and of renormalising the chosen experts' weights."""
    if raw.get("mlp_only_layers"):
        raise ValueError(
            f"--hf-config {str(file)!r}: mlp_only_layers={raw['mlp_only_layers']!r} makes those layers dense, which the"
            " zoo MoE's moe_every cannot say; plan it with mlp_only_layers=[] in a copy (a few layers' difference)"
        )
    return {
        **MIXTRAL_ROUTING,
        "moe_every": _integer(raw, "decoder_sparse_step", file) if "decoder_sparse_step" in raw else 1,
        "normalize_top_k": bool(raw.get("norm_topk_prob", False)),
    }


def _integer(raw: dict[str, Any], key: str, file: Path) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"--hf-config {str(file)!r}: {key}={value!r}; the planner needs it as a whole number >= 1 (every"
            " config transformers saves has it)"
        )
    return value
