"""GPT-2 (GPT2Model, GPT2LMHeadModel): transformers ships no TP plan for it; this is ours.

GPT-2's linears are Conv1D (weight (in, out)) and q, k, v are one fused Conv1D (c_attn): custom styles
(lit_mesh/hf/conv1d.py) split them, the attention splits c_attn's output at its local width. With SP the
first block shards its input over the sequence (the model adds position embeddings to the token embeddings
first), the layer norms run on the shard, attention and MLP gather it. The token embedding stays whole: it
is tied to the head (lm_head), which gathers the sequence and computes all logits on every rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from lit_mesh.hf.blocks import base_prefix, hf_config
from lit_mesh.hf.context import not_offered
from lit_mesh.hf.conv1d import Conv1DColwise, Conv1DRowwise, LocalSplitWidth
from lit_mesh.hf.pipeline import decoder_pipeline_plan
from lit_mesh.plan import ParallelPlan, PipelinePlan, TensorPlan


def _between_blocks(sequence_parallel: bool) -> Shard | Replicate:
    return Shard(1) if sequence_parallel else Replicate()


CUSTOM_STYLES = {
    "gpt2_attention": lambda sp: LocalSplitWidth("split_size", sp),
    "conv1d_qkv": lambda sp: Conv1DColwise(parts=3),
    "conv1d_colwise": lambda sp: Conv1DColwise(),
    "conv1d_rowwise": lambda sp: Conv1DRowwise(_between_blocks(sp)),
}


def gpt2_plan(model: nn.Module) -> ParallelPlan:
    config, base = hf_config(model), base_prefix(model)
    root = {f"{base}h.0": "shard_input", f"{base}ln_f": "norm"}
    if hasattr(model, "lm_head"):
        root["lm_head"] = "gather_input"
    return ParallelPlan(
        cp=not_offered(type(model).__name__),
        blocks=f"{base}h",
        tp=TensorPlan(
            root=root,
            block={
                "ln_1": "norm",
                "attn": "gpt2_attention",
                "attn.c_attn": "conv1d_qkv",
                "attn.c_proj": "conv1d_rowwise",
                "ln_2": "norm",
                "mlp": "gather_input",
                "mlp.c_fc": "conv1d_colwise",
                "mlp.c_proj": "conv1d_rowwise",
            },
            divides={"n_head": config.n_head, "n_inner (MLP width)": config.n_inner or 4 * config.n_embd},
            custom_styles=CUSTOM_STYLES,
        ),
        # the head is tied to wte (GPT-2's default): the first and the last stage each hold a copy
        # (lit_mesh/parallel/pipeline/tied.py); later stages add zeros for the position embeddings
        pp=(
            decoder_pipeline_plan(base, ("wte", "wpe", "drop"), "ln_f", wpe="zeros", drop="identity")
            if hasattr(model, "lm_head")
            else PipelinePlan()
        ),
    )
