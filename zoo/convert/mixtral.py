"""zoo MoE (MoETransformer) <-> transformers MixtralForCausalLM. The same maths for the Mixtral-style zoo
config: the zoo GPT's attention (as Llama), every layer MoE, softmax over all experts then the top k
renormalised (transformers' MixtralTopKRouter, the zoo's default routing), dropless, SwiGLU experts.

Layouts: transformers stores the experts fused and transposed, gate_up_proj (E, 2 * hidden, dim) = [gate; up]
and down_proj (E, dim, hidden); the zoo keeps w1, w3 (E, dim, hidden) and w2 (E, hidden, dim). `pack` builds
the fused tensor under a zoo-side name (`experts.w13`) before renaming, `unpack` splits it after.
transformers writes directories in the hub's layout (per-expert w1/w2/w3 under block_sparse_moe), which
`from_checkpoint` reads. The zoo's balancing bias (a buffer) has no Mixtral counterpart: it must be zero.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lit_mesh.extras import require
from zoo.convert.llama import ATTENTION_LAYER, explicit_head_dim
from zoo.convert.rules import ConversionError, Converter, Rule
from zoo.moe import MoEConfig, MoETransformer

_W1, _W3, _W13 = ".moe.experts.w1", ".moe.experts.w3", ".moe.experts.w13"


def to_mixtral_config(c: MoEConfig) -> Any:
    MixtralConfig = require("transformers").MixtralConfig

    differs = {
        "score_func": (c.score_func, "softmax"),
        "normalize_top_k": (c.normalize_top_k, True),
        "n_shared_experts": (c.n_shared_experts, 0),
        "moe_every": (c.moe_every, 1),
        "capacity_factor": (c.capacity_factor, None),
        "bias_update_rate": (c.bias_update_rate, 0.0),
    }
    unlike = {name: given for name, (given, mixtral) in differs.items() if given != mixtral}
    _check_more_than_one_expert_per_token(c.top_k, "top_k")
    if unlike:
        raise ValueError(
            f"MoEConfig with {unlike}: Mixtral routes every layer's tokens by softmax over all experts, top-k"
            f" renormalised, dropless, without shared experts or a balancing bias; convert a zoo MoE built with"
            f" { ({name: differs[name][1] for name in unlike}) }"
        )
    return MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.expert_hidden,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.attention_head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        sliding_window=None,
        num_local_experts=c.n_experts,
        num_experts_per_tok=c.top_k,
        router_aux_loss_coef=c.aux_loss_coef,
        router_jitter_noise=0.0,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )


def _check_more_than_one_expert_per_token(top_k: int, name: str) -> None:
    if top_k == 1:  # Mixtral renormalises one chosen probability to 1; the zoo MoE keeps it (Switch)
        raise ValueError(
            f"{name}=1: a single routed expert is gated by 1 in Mixtral and by its probability in the"
            f" zoo MoE, so their outputs differ; convert a model with {name} >= 2"
        )


def to_moe_config(c: Any) -> MoEConfig:
    rope = c.rope_parameters or {}
    _check_more_than_one_expert_per_token(c.num_experts_per_tok, "num_experts_per_tok")
    unlike = {
        "rope_type": rope.get("rope_type", "default") != "default",
        "hidden_act": c.hidden_act != "silu",
        "sliding_window": c.sliding_window is not None,
        "router_jitter_noise": bool(c.router_jitter_noise),
        "tie_word_embeddings": bool(c.tie_word_embeddings),
    }
    if any(unlike.values()):
        values = {**vars(c), "rope_type": rope.get("rope_type")}
        given = {name: values.get(name) for name, bad in unlike.items() if bad}
        raise ValueError(
            f"{type(c).__name__} with {given}: the zoo MoE has default RoPE, SiLU experts, full causal attention,"
            " no router jitter and an output head apart from the embedding; convert a Mixtral config with"
            " rope_type='default', hidden_act='silu', sliding_window=None, router_jitter_noise=0,"
            " tie_word_embeddings=False"
        )
    return MoEConfig(
        vocab_size=c.vocab_size,
        dim=c.hidden_size,
        n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        ffn_hidden=c.intermediate_size,
        n_experts=c.num_local_experts,
        top_k=c.num_experts_per_tok,
        expert_hidden=c.intermediate_size,
        aux_loss_coef=c.router_aux_loss_coef,
        norm_eps=c.rms_norm_eps,
        rope_theta=rope.get("rope_theta", 1e6),
        max_seq_len=c.max_position_embeddings,
        head_dim=explicit_head_dim(getattr(c, "head_dim", None), c.hidden_size, c.num_attention_heads),
    )


def _mixtral(config: Any) -> Any:
    MixtralForCausalLM = require("transformers").MixtralForCausalLM

    return MixtralForCausalLM(config)


def _pack(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """w1, w3 (E, dim, hidden) -> w13 (E, 2 * hidden, dim), transformers' [gate; up] layout."""
    out = {k: v for k, v in state.items() if not k.endswith((_W1, _W3))}
    for key in (k for k in state if k.endswith(_W1)):
        layer = key[: -len(_W1)]
        w1, w3 = state[key], state.get(layer + _W3)
        if w3 is None or w1.shape != w3.shape:
            raise ConversionError(
                f"{key} {tuple(w1.shape)} and {layer + _W3} {None if w3 is None else tuple(w3.shape)} must be the"
                " same shape (n_experts, dim, expert_hidden) to form Mixtral's gate_up_proj; convert a complete zoo"
                " MoE state dict"
            )
        out[layer + _W13] = torch.cat([w1.transpose(1, 2), w3.transpose(1, 2)], dim=1).contiguous()
    return out


def _unpack(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in state.items() if not k.endswith(_W13)}
    for key in (k for k in state if k.endswith(_W13)):
        w13, layer = state[key], key[: -len(_W13)]
        if w13.dim() != 3 or w13.shape[1] % 2:
            raise ConversionError(
                f"gate_up_proj of {layer} has shape {tuple(w13.shape)}: expected (num_local_experts,"
                " 2 * intermediate_size, hidden_size); convert a MixtralForCausalLM state dict"
            )
        gate, up = w13.chunk(2, dim=1)
        out[layer + _W1], out[layer + _W3] = gate.transpose(1, 2).contiguous(), up.transpose(1, 2).contiguous()
    return out


_HUB_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def _from_hub_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's Mixtral layout, which save_pretrained writes (block_sparse_moe, one w1/w2/w3 (out, in) per
    expert), -> the model's in memory (mlp, fused stacked experts); tensors already in memory layout pass."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _HUB_EXPERT.match(key)
        if match:
            experts.setdefault((match[1], match[3]), {})[int(match[2])] = tensor
        else:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer in sorted({layer for layer, _ in experts}):
        stacked = {}
        for w in ("w1", "w2", "w3"):
            found = experts.get((layer, w), {})
            if sorted(found) != list(range(len(found))) or not found:
                raise ConversionError(
                    f"{layer}.block_sparse_moe.experts.*.{w}.weight: experts {sorted(found)} found, expected 0..n-1"
                )
            stacked[w] = torch.stack([found[e] for e in range(len(found))])
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stacked["w1"], stacked["w3"]], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stacked["w2"]
    return out


def _transpose(tensor: torch.Tensor, _config: Any) -> torch.Tensor:  # w2 (E, hidden, dim) <-> down_proj
    return tensor.transpose(1, 2).contiguous()


def _no_bias(c: MoEConfig) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.moe.router.expert_bias.bias": torch.zeros(c.n_experts) for i in range(c.n_layers)}


_LAYER = [
    *ATTENTION_LAYER,
    ("moe.router.gate.weight", "mlp.gate.weight"),
    ("moe.experts.w13", "mlp.experts.gate_up_proj"),
]

MIXTRAL = Converter(
    name="mixtral",
    zoo_model=MoETransformer,
    hf_model=_mixtral,
    to_hf_config=to_mixtral_config,
    to_zoo_config=to_moe_config,
    zoo_only=_no_bias,
    pack=_pack,
    unpack=_unpack,
    from_checkpoint=_from_hub_layout,
    rules=[
        Rule("tok_embeddings.weight", "model.embed_tokens.weight"),
        *(Rule(f"layers.{{i}}.{zoo}", f"model.layers.{{i}}.{hf}") for zoo, hf in _LAYER),
        Rule("layers.{i}.moe.experts.w2", "model.layers.{i}.mlp.experts.down_proj", _transpose, _transpose),
        Rule("norm.weight", "model.norm.weight"),
        Rule("output.weight", "lm_head.weight"),
    ],
)
