"""A ParallelPlan from the tensor-parallel plan transformers ships with a model (`config.base_model_tp_plan`
and the head's `_tp_plan`, merged by transformers into `model._tp_plan`), plus sequence parallelism around it.

transformers' plan says which linears are column- or row-wise; it says nothing about sequence parallelism.
For a block made of norms, an attention and an MLP (Llama, Qwen2, Mistral and alike) SP follows from the
structure: the norms run on the sequence shard, the sub-modules that hold split linears gather the sequence
first, the first block shards its input (the model reads the sequence length before its blocks, so the
embedding must hand on whole activations), and the final norm runs on the shard before the head gathers.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from lit_mesh.hf.blocks import base_prefix, find_blocks, hf_config
from lit_mesh.hf.context import not_offered
from lit_mesh.plan import ParallelPlan, TensorPlan, TPStyle

# transformers' style names -> ours; anything else is refused by name
HF_STYLES: dict[str, TPStyle] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "head",
    "embedding_rowwise": "embedding_whole_output",  # the model reads the embeddings' length before its layers
    # a replicated module whose gradient tp sums: applied to the norms of one head's features (Qwen3's q_norm and
    # k_norm, `_per_head_norm`), which see this rank's heads; anything else of this style is refused
    "replicated_with_grad_allreduce": "heads_norm",
}
_SPLIT = ("colwise", "rowwise")


def is_norm(module: nn.Module) -> bool:
    # transformers names its norms <Model>RMSNorm / <Model>LayerNorm (the same test its own init uses)
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """transformers' merged plan for this model, full module names ('*' for the layer index)."""
    return dict(getattr(model, "_tp_plan", None) or {})


def plan_from_hf(model: nn.Module, tp_divides: dict[str, int], hf_plan: dict[str, str] | None = None) -> ParallelPlan:
    """The plan for a model whose transformers TP plan (or `hf_plan`, a part of it) uses only styles we apply;
    `tp.unavailable` otherwise."""
    name = type(model).__name__
    blocks = find_blocks(model)
    if blocks is None:
        raise ValueError(f"{name}: no ModuleList of its _no_split_modules {getattr(model, '_no_split_modules', None)}")
    hf_plan = hf_tp_plan(model) if hf_plan is None else hf_plan
    layer = cast(nn.ModuleList, model.get_submodule(blocks))[0]  # find_blocks names a ModuleList
    in_block = f"{blocks}.*."
    unknown = {
        key: style
        for key, style in hf_plan.items()
        if style not in HF_STYLES
        or (HF_STYLES[style] == "heads_norm" and not _per_head_norm(model, layer, key.removeprefix(in_block)))
    }
    if not hf_plan or unknown:
        why = (
            f"transformers' tensor-parallel plan of {name} uses styles lit-mesh does not apply: {unknown}"
            if unknown
            else f"{name}'s config has no base_model_tp_plan"
        )
        return ParallelPlan(blocks=blocks, tp=TensorPlan(unavailable=no_plan_message(name, why)), cp=not_offered(name))

    root: dict[str, TPStyle] = {}
    block: dict[str, TPStyle] = {}
    for key, style in hf_plan.items():
        if key.startswith(in_block):
            block[key[len(in_block) :]] = HF_STYLES[style]
        else:
            root[key] = HF_STYLES[style]

    # sequence parallelism around the split linears
    for child_name, child in layer.named_children():
        if is_norm(child):
            block[child_name] = "norm"
        elif any(key.startswith(f"{child_name}.") and block[key] in _SPLIT for key in block):
            block[child_name] = "gather_input"
    root[f"{blocks}.0"] = "shard_input"
    base = base_prefix(model)
    for child_name, child in model.get_submodule(base.rstrip(".")).named_children() if base else model.named_children():
        if is_norm(child):
            root[f"{base}{child_name}"] = "norm"  # the final norm: after the blocks, before the head
    head = next((key for key, style in root.items() if style == "head"), None)
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if head is None and output is not None:
        # a head left whole (replicated) takes the whole sequence
        head_name = next(n for n, m in model.named_modules() if m is output)
        root[head_name] = "gather_input"
    return ParallelPlan(blocks=blocks, tp=TensorPlan(root=root, block=block, divides=tp_divides), cp=not_offered(name))


def _per_head_norm(model: nn.Module, layer: nn.Module, name: str) -> bool:
    """Whether `name` (inside a block) is a norm over one attention head's features: its weight as wide as the
    config's head_dim."""
    try:
        module = layer.get_submodule(name)
    except AttributeError:
        return False
    config = hf_config(model)  # a decoder's: the plan names attention norms
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weight = getattr(module, "weight", None)
    return is_norm(module) and isinstance(weight, torch.Tensor) and tuple(weight.shape) == (head_dim,)


def no_plan_message(model_name: str, why: str) -> str:
    return (
        f"no tensor-parallel plan is known for the transformers model {model_name} ({why}). Supply one:"
        f" lit_mesh.hf.register_plan({model_name!r}, builder) with a builder(model) -> lit_mesh.ParallelPlan"
        " (see lit_mesh/hf/gpt2.py), or give the LightningModule's model a parallel_plan(); or train it with"
        " tp=1 (FSDP/HSDP/DDP per block need no plan)"
    )
