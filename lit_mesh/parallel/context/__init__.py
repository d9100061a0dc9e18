"""Context parallelism (cp > 1): the sequence of every sample split over the cp ranks, attention exact across the
split. apply.py swaps the style's attention into a model (its module doc tells the styles apart), attention.py and
kernels.py compute it, layout.py cuts sequences and batches (and holds the cp_style option), rules.py says what CP
combines with."""

from lit_mesh.parallel.context.apply import ContextParallelAttention, apply_context_parallel, cp_plan_problem
from lit_mesh.parallel.context.attention import context_parallel_attention
from lit_mesh.parallel.context.layout import (
    CP_STYLES,
    SEQUENCE_DIM,
    ContextOptions,
    ContextParallelError,
    CPStyle,
    check_cp_style,
    gather_batch,
    is_load_balanced,
    local_chunks,
    local_positions,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "CP_STYLES",
    "SEQUENCE_DIM",
    "ContextOptions",
    "ContextParallelAttention",
    "ContextParallelError",
    "CPStyle",
    "apply_context_parallel",
    "check_cp_style",
    "context_parallel_attention",
    "cp_plan_problem",
    "gather_batch",
    "is_load_balanced",
    "local_chunks",
    "local_positions",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
]
