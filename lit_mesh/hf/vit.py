"""ViT (ViTModel, ViTForImageClassification): transformers ships no TP plan for it; this is ours.

The layer is the zoo ViT's in transformers' names: q/k/v and fc1 column-wise, o_proj and fc2 row-wise; with
SP the first layer shards its input over the sequence (the token count, patches + 1, must divide by tp; the
model builds its attention mask from the whole embeddings first) and the final layernorm gathers it again
before the class token is read.
"""

from __future__ import annotations

from torch import nn

from lit_mesh.hf.blocks import base_prefix, find_blocks, hf_config
from lit_mesh.hf.context import not_offered
from lit_mesh.plan import ParallelPlan, TensorPlan


def vit_plan(model: nn.Module) -> ParallelPlan:
    config, base = hf_config(model), base_prefix(model)
    blocks = find_blocks(model) or f"{base}layers"
    return ParallelPlan(
        cp=not_offered(type(model).__name__),
        blocks=blocks,
        tp=TensorPlan(
            root={f"{blocks}.0": "shard_input", f"{base}layernorm": "gather_input"},
            block={
                "layernorm_before": "norm",
                "attention": "gather_input",  # called as attention(hidden_states, attention_mask)
                "attention.q_proj": "colwise",
                "attention.k_proj": "colwise",
                "attention.v_proj": "colwise",
                "attention.o_proj": "rowwise",
                "layernorm_after": "norm",
                "mlp": "gather_input",
                "mlp.fc1": "colwise",
                "mlp.fc2": "rowwise",
            },
            divides={"num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size},
        ),
    )
