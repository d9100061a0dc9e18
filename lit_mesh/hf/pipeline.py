"""Pipeline stages of transformers decoders (Llama, Qwen2, Mistral, GPT-2): what their PipelinePlan declares.

A stage is the transformers model pruned to its decoder layers (lit_mesh/parallel/pipeline/split.py), run by its
own forward: the first stage from token ids, later ones from hidden states (`inputs_embeds`); the modules a stage
does not hold are None (the token embedding: `inputs_embeds` skips it) or stand-ins (the final norm and the head
pass hidden states on, GPT-2's position embeddings add zeros). So every stage computes the positions, the rotary
embeddings (a buffer module beside the layers, on every stage) and the causal mask itself, as transformers does.
Under sequence parallelism a stage after the first receives its tp rank's shard of the sequence, while its attention
sees the whole (gathered) sequence: it is given the positions and the causal mask of the whole sequence. Under context
parallel a stage holds its cp rank's shard of the sequence, so its global positions come in as `position_ids`
(context parallel's hook on every stage, lit_mesh/parallel/context/apply.py, which counts sequence parallelism's
shards too), and the layers' attention is context parallel's, with no mask (lit_mesh/hf/context.py).

No cache, no padding: a stage takes one tensor. An `attention_mask` is refused under pp
(lit_mesh/hf/pipelined_call.py).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import Tensor, nn

from lit_mesh.hf.pipelined_call import take_calls
from lit_mesh.parallel.pipeline.split import global_positions
from lit_mesh.plan import PipelinePlan


class TransformersStage(nn.Module):
    """One pipeline stage of a transformers causal LM: token ids or hidden states in, logits or hidden states out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # how many shards of the sequence the hidden states this stage receives are (tp under sequence parallelism,
        # for stages after the first: lit_mesh/parallel/apply.py); 1: the whole sequence
        self.sequence_shards = 1

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """`position_ids` (1, T): the global positions of the tokens in x where they do not start at 0 (a cp shard)."""
        inputs: dict[str, object] = {"inputs_embeds": x} if x.is_floating_point() else {"input_ids": x}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        elif x.is_floating_point() and self.sequence_shards > 1:
            inputs.update(self._whole_sequence(x))
        # the class's forward: the model's own is taken over by the pipeline (lit_mesh/hf/pipelined_call.py)
        out = type(self.model).forward(self.model, **inputs, use_cache=False).logits
        # GPT-2 views its output as (-1, its input's length, width): under sequence parallelism the lengths of a
        # stage's input and output differ (ids of T in, a shard out; a shard in, T out): its batch is the input's
        if out.shape[0] != x.shape[0]:
            out = out.reshape(x.shape[0], -1, out.shape[-1])
        # torch's split-backward schedules (zbv, dualpipev) detach a stage's output in place, which a view refuses
        # (the head's stand-in passes on a slice of the hidden states): a copy, after which the base can be freed
        return out.clone() if out._is_view() else out

    def _whole_sequence(self, shard: Tensor) -> dict[str, object]:
        """The positions and the causal mask of the whole sequence, for hidden states that are one shard of it:
        counted from the shard, both would cover T / shards tokens (rotary angles from 0 on every shard, a mask of
        the wrong size for eager attention)."""
        from transformers.masking_utils import create_causal_mask

        position_ids = global_positions(shard, self.sequence_shards).unsqueeze(0)
        batch, length, width = shard.shape[0], position_ids.shape[1], shard.shape[2]
        # the mask builder reads only the shape, dtype and device of the embeddings: a view without storage
        whole = torch.empty((), dtype=shard.dtype, device=shard.device).expand(batch, length, width)
        # no position_ids: given, transformers reads them on the host to detect packed sequences, which these
        # positions (0 .. T-1) are not
        mask = create_causal_mask(config=self.model.config, inputs_embeds=whole, attention_mask=None, cache=None)
        # None: SDPA's own causal flag, which the gathered sequence meets (no mask to size)
        return {"position_ids": position_ids, "attention_mask": mask}


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
