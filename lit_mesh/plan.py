"""What a model declares about how it may be parallelised. Plain data; `lit_mesh.parallel` applies it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
#   vocab_embedding  Embedding split over the vocabulary, output summed to whole (replicated) activations even
#                with SP: for models that read the sequence length from it before their blocks
#   shard_hidden_states   a module whose hidden states (first positional input, or `hidden_states=`) enter the
#                sequence-sharded region (SP only): e.g. the first decoder layer of a model that reads the
#                sequence length between its embedding and its layers (Hugging Face models)
#   gather_hidden_states  a module whose hidden states (first positional input, or `hidden_states=`) leave the
#                sequence-sharded region (SP only); its other inputs pass untouched
#   vocab_head   the output head like "head", but its logits stay a DTensor sharded over the vocabulary, for a
#                loss that takes them so (lit_mesh.loss.cross_entropy: loss parallel); "head" where pp > 1
TPStyle = Literal[
    "colwise", "rowwise", "embedding", "shard_output", "norm", "gather_input", "head", "vocab_head",
    "vocab_embedding", "shard_hidden_states", "gather_hidden_states", "whole_sequence",
]  # fmt: skip
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
    pp_first:   direct children that run before the blocks (embeddings): they go to the first pipeline stage.
    pp_last:    direct children that run after the blocks (final norm, output head): the last stage.
                A pipeline stage sets the ones it does not hold to None, so the forward must skip None
                modules and pass hidden states through (see zoo/gpt.py).
    attention:  the module inside every block whose forward calls F.scaled_dot_product_attention on
                (batch, heads, sequence, head_dim) tensors: context parallel swaps that call ("" : none).
    positions:  the keyword of the model's forward that takes the global positions (T,) of its tokens:
                context parallel passes each rank's, and pipeline stages after the first get them under
                sequence parallelism (their input is a sequence shard) ("" : none; cp > 1 then is refused).
    tp_unavailable: why this model cannot be tensor-parallelised and how to fix that; tp > 1 then fails
                with this message (a plan for data parallelism only).
    custom_styles: TP styles of the model's own, by name (usable in tp_root/tp_block): a function of
                sequence_parallel returning a torch ParallelStyle, for modules the built-in styles do not fit.
    moe_layer:  name, inside a block, of its mixture-of-experts layer (blocks without one are dense). The layer
                has `experts` (stacked weights, n_experts first) and `dispatcher`, which expert parallel swaps.
    ep_divides: sizes that the ep degree must divide, by name (number of experts).
    moe_adapter: for a model whose MoE layer has no `experts`/`dispatcher` of that kind (transformers'
                Mixtral): a function called on every MoE layer before anything else is applied, on every
                layout, that makes it so in place (lit_mesh/hf/mixtral.py). None: the layer already is.
    """

    blocks: str
    tp_root: Mapping[str, TPStyle] = field(default_factory=dict)
    tp_block: Mapping[str, TPStyle] = field(default_factory=dict)
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    init: Sequence[tuple[str, Init]] = ()
    pp_first: Sequence[str] = ()
    pp_last: Sequence[str] = ()
    attention: str = ""
    positions: str = ""
    tp_unavailable: str = ""
    custom_styles: Mapping[str, Callable[[bool], Any]] = field(default_factory=dict)
    moe_layer: str = ""
    ep_divides: Mapping[str, int] = field(default_factory=dict)
    moe_adapter: Callable[[Any], None] | None = None

    def __post_init__(self) -> None:
        for name, style in {**self.tp_root, **self.tp_block}.items():
            if style not in TP_STYLES and style not in self.custom_styles:
                raise ValueError(f"ParallelPlan: module {name!r} has TP style {style!r}; choose one of {TP_STYLES}")
