"""GPT-2 (GPT2Model, GPT2LMHeadModel): FSDP per block (transformer.h).

Tensor parallelism is refused with a clear message: GPT-2 projects q, k and v with ONE fused Conv1D
(c_attn, weight (in, 3 x dim)), splits its output at the global width (`split_size`), and Conv1D is not a
Linear that torch's ParallelStyles shard.
"""

from __future__ import annotations

from torch import nn

from lit_mesh.hf.blocks import base_prefix
from lit_mesh.hf.from_config import no_plan_message
from lit_mesh.plan import ParallelPlan


def gpt2_plan(model: nn.Module) -> ParallelPlan:
    why = "its attention projects q, k and v with one fused Conv1D (c_attn) split at the global width"
    return ParallelPlan(blocks=f"{base_prefix(model)}h", tp_unavailable=no_plan_message(type(model).__name__, why))
