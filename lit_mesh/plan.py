"""What a model declares about how it may be parallelised. Plain data; `lit_mesh.parallel` applies it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lit_mesh.init import Init

# How one module takes part in tensor/sequence parallelism (see lit_mesh/parallel/tensor.py):
#   colwise      Linear whose output features are split over tp (input replicated)
#   rowwise      Linear whose input features are split over tp; output summed (or reduce-scattered over
#                the sequence when sequence_parallel)
#   embedding    Embedding split over the vocabulary; with SP its output enters the sequence-sharded region
#   shard_output a module whose replicated output enters the sequence-sharded region (SP only)
#   norm         a norm that runs on the sequence shard (SP only; replicated otherwise)
#   gather_input a module whose first positional input leaves the sequence-sharded region (SP only);
#                other inputs must be passed as keywords
#   head         the output projection: split over its output features, gathered to full logits
#   whole_sequence a module that runs replicated on the whole sequence (e.g. an MoE layer): its first input is
#                gathered, its output re-sharded over the sequence (SP only)
TPStyle = Literal["colwise", "rowwise", "embedding", "shard_output", "norm", "gather_input", "head", "whole_sequence"]
TP_STYLES: tuple[str, ...] = TPStyle.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ParallelPlan:
    """A model's parallel layout, by module name.

    blocks:     dotted path of the ModuleList of repeated blocks: the FSDP units.
    tp_root:    TP styles of modules outside the blocks, names relative to the model.
    tp_block:   TP styles of modules inside every block, names relative to the block.
    tp_divides: sizes that the tp degree must divide, by name (heads, kv heads, FFN width, vocabulary).
    init:       (parameter-name glob, Init) rules, first match wins: how each parameter starts, so a
                sharded model materialised on many ranks equals the single-device one.
    moe_layer:  name, inside a block, of its mixture-of-experts layer (blocks without one are dense). The layer
                has `experts` (stacked weights, n_experts first) and `dispatcher`, which expert parallel swaps.
    ep_divides: sizes that the ep degree must divide, by name (number of experts).
    """

    blocks: str
    tp_root: Mapping[str, TPStyle] = field(default_factory=dict)
    tp_block: Mapping[str, TPStyle] = field(default_factory=dict)
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    init: Sequence[tuple[str, Init]] = ()
    moe_layer: str = ""
    ep_divides: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, style in {**self.tp_root, **self.tp_block}.items():
            if style not in TP_STYLES:
                raise ValueError(f"ParallelPlan: module {name!r} has TP style {style!r}; choose one of {TP_STYLES}")
