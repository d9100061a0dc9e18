"""Pipeline stages of transformers decoders (Llama, Qwen2, Mistral, GPT-2): what their PipelinePlan declares.

A stage is the transformers model pruned to its decoder layers (lit_mesh/parallel/pipeline/split.py), run by its
own forward: the first stage from token ids, later ones from hidden states (`inputs_embeds`); the modules a stage
does not hold are None (the token embedding: `inputs_embeds` skips it) or stand-ins (the final norm and the head
pass hidden states on, GPT-2's position embeddings add zeros). So every stage computes the positions, the rotary
embeddings (a buffer module beside the layers, on every stage) and the causal mask itself, as transformers does.
Under context parallel a stage holds its cp rank's shard of the sequence, so its global positions come in as
`position_ids` (context parallel's hook on every stage, lit_mesh/parallel/context/apply.py), and the layers' attention
is context parallel's, with no mask (lit_mesh/hf/context.py).

No cache, no padding: a stage takes one tensor. An `attention_mask` is refused under pp
(lit_mesh/hf/pipelined_call.py).
"""

from __future__ import annotations

from typing import Literal, Optional

from torch import Tensor, nn

from lit_mesh.hf.pipelined_call import take_calls
from lit_mesh.plan import PipelinePlan


class TransformersStage(nn.Module):
    """One pipeline stage of a transformers causal LM: token ids or hidden states in, logits or hidden states out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """`position_ids` (1, T): the global positions of the tokens in x where they do not start at 0 (a cp shard)."""
        inputs = {"inputs_embeds": x} if x.is_floating_point() else {"input_ids": x}
        # the class's forward: the model's own is taken over by the pipeline (lit_mesh/hf/pipelined_call.py)
        return type(self.model).forward(self.model, **inputs, position_ids=position_ids, use_cache=False).logits


def decoder_pipeline_plan(
    base: str, first: tuple[str, ...], last_norm: str, **stand_ins: Literal["identity", "zeros"]
) -> PipelinePlan:
    """The PipelinePlan of a transformers causal LM whose base model is under `base` ('model.', 'transformer.'):
    `first` the modules before the layers (under the base), `last_norm` the final norm, then `lm_head`."""
    return PipelinePlan(
        first=tuple(f"{base}{name}" for name in first),
        last=(f"{base}{last_norm}", "lm_head"),
        stand_ins={
            f"{base}{last_norm}": "identity",
            "lm_head": "identity",
            **{f"{base}{name}": kind for name, kind in stand_ins.items()},
        },
        stage=TransformersStage,
        calls=take_calls,
    )
