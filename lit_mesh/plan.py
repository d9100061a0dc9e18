"""What a model declares about how it may be parallelised. Plain data; `lit_mesh.parallel` applies it.

A plan names the repeated blocks and how parameters start, then one small sub-plan per technique:

    ParallelPlan(
        blocks="layers",
        tp=TensorPlan(root={"tok_embeddings": "embedding", ...}, block={"attention.wq": "colwise", ...}),
        pp=PipelinePlan(first=("tok_embeddings",), last=("norm", "output")),
        cp=ContextPlan(attention="attention", positions="positions"),
        init=(("*", Init("normal", 0.02)),),
    )

A module declares its plan with a `parallel_plan()` method; models that cannot carry one (transformers'
classes) get theirs from a registered plan source (`register_plan_source`, see lit_mesh/hf/registry.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch import nn

from lit_mesh.errors import PlanError  # noqa: F401 - re-exported (lit_mesh.plan.PlanError)

if TYPE_CHECKING:  # a type only: lit_mesh.init (materialisation) reads plans, so it must not be imported here
    from lit_mesh.init import Init


# How one module takes part in tensor/sequence parallelism (see lit_mesh/parallel/tensor.py). "The hidden
# states" of a module are its first positional input, else its `hidden_states=` keyword (Hugging Face layers
# get them either way); its other inputs pass untouched.
#   colwise        Linear whose output features are split over tp (input replicated)
#   rowwise        Linear whose input features are split over tp; output summed (or reduce-scattered over
#                  the sequence when sequence_parallel)
#   embedding      Embedding split over the vocabulary; its output is what runs between blocks: summed whole,
#                  or reduce-scattered straight into the sequence shard under SP
#   embedding_whole_output  Embedding split over the vocabulary, output summed whole on every tp rank even under
#                  SP: for models that read the activations (their sequence length) between the embedding and
#                  their blocks; the first block then takes `shard_input`. Not a synonym of "embedding": under
#                  SP one reduce-scatters, the other all-reduces (twice the bytes) and leaves sharding to later.
#   head           the output projection: split over its output features, gathered to full logits
#   norm           a norm that runs on the sequence shard (SP only; replicated otherwise)
#   shard_output   a module whose output (replicated) enters the sequence-sharded region (SP only)
#   shard_input    a module whose hidden states enter the sequence-sharded region (SP only): where the model
#                  computes its first block's input inline (no module's output to shard), e.g. GPT-2 adding
#                  position embeddings. Same redistribution as shard_output, on the consumer's side.
#   gather_input   a region (attention, MLP) whose hidden states leave the sequence-sharded region: gathered once
#                  and handed to its column-wise linears as a replicated DTensor, so their input gradients are
#                  summed and reduce-scattered (SP) or all-reduced once per region, Megatron's bytes; the module's
#                  output must be a plain tensor (its last linear rowwise) or replicated
#   whole_sequence a module that runs replicated on the whole sequence (e.g. an MoE layer): its first input is
#                  gathered, its output re-sharded over the sequence (SP only)
#   vocab_head     the output head like "head", but its logits stay a DTensor sharded over the vocabulary, for a
#                  loss that takes them so (lit_mesh.loss.cross_entropy: loss parallel); "head" where pp > 1
#   heads_norm     a norm over each attention head's features (Qwen3's q_norm / k_norm) that sees this rank's heads,
#                  (batch, sequence, heads, head_dim): its weight replicated, its gradient summed over tp
#   sequence_shard a module that runs on this rank's shard of the sequence as it is, its output that shard (SP only:
#                  an MoE layer under expert_tp=1, lit_mesh/parallel/expert.py, sets it for the plan's MoE layer)
#   token_wise     a module applied token by token to (tokens, features) inside a sequence_shard module (an MoE
#                  router, shared experts): each tp rank runs it on its own tokens; weights replicated, their
#                  gradients summed over tp (torch's SequenceParallel over dim 0)
TPStyle = Literal[
    "colwise",
    "rowwise",
    "embedding",
    "embedding_whole_output",
    "head",
    "vocab_head",
    "norm",
    "shard_output",
    "shard_input",
    "gather_input",
    "whole_sequence",
    "heads_norm",
    "sequence_shard",
    "token_wise",
]
TP_STYLES: tuple[str, ...] = TPStyle.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TensorPlan:
    """Tensor (and sequence) parallelism: TP styles by module name.

    root:    styles of modules outside the blocks, names relative to the model.
    block:   styles of modules inside every block, names relative to the block.
    divides: sizes that the tp degree must divide, by name (heads, kv heads, FFN width, vocabulary).
    custom_styles: styles of the model's own, by name (usable in root/block): a function of
             sequence_parallel returning a torch ParallelStyle, for modules the built-in styles do not fit.
    unavailable: why this model cannot be tensor-parallelised and how to fix that; tp > 1 then fails with
             this message (a plan for data parallelism only).
    """

    root: Mapping[str, TPStyle | str] = field(default_factory=dict)  # str: a name in custom_styles
    block: Mapping[str, TPStyle | str] = field(default_factory=dict)
    divides: Mapping[str, int] = field(default_factory=dict)
    custom_styles: Mapping[str, Callable[[bool], Any]] = field(default_factory=dict)
    unavailable: str = ""

    def __post_init__(self) -> None:
        for name, style in {**self.root, **self.block}.items():
            if style not in TP_STYLES and style not in self.custom_styles:
                raise ValueError(f"TensorPlan: module {name!r} has TP style {style!r}; choose one of {TP_STYLES}")


@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline parallelism: what goes to the first and last stages besides their blocks.

    first: modules that run before the blocks (embeddings), by dotted name.
    last:  modules that run after the blocks (final norm, output head), by dotted name.
    A stage sets the ones it does not hold to None, so the forward must skip None modules and pass hidden
    states through (see zoo/gpt.py). Empty: the model cannot be pipelined.
    balance: how stages share the blocks when pp_split is not given: "blocks" (as many blocks each, counting
    first and last as one block each) or "parameters" (as many parameters each: blocks of unequal sizes, such as
    the children of a plain nn.Sequential).
    """

    first: Sequence[str] = ()
    last: Sequence[str] = ()
    balance: Literal["blocks", "parameters"] = "blocks"
    # what a stage puts in place of a first/last module it does not hold (default None): "identity" passes its
    # input on, "zeros" gives 0 (a model that adds the module's output, such as GPT-2's position embeddings)
    stand_ins: Mapping[str, Literal["identity", "zeros"]] = field(default_factory=dict)
    # the module that runs one stage, made from the pruned model (forward(x) -> tensor: token ids on the first
    # stage, hidden states after it; logits from the last); None: the pruned model itself (lit_mesh.hf's stages
    # for transformers models, whose forward takes keywords and returns an output object). Under sequence
    # parallelism a stage module's `sequence_shards` (if it has one) is set to tp on stages after the first: their
    # input is one shard of the sequence, and the stage gives its layers the whole sequence's positions and mask
    stage: Callable[[nn.Module], nn.Module] | None = None
    # makes a call of the whole (pruned) model run its pipeline inside MeshStrategy's steps (the user's own call of a
    # transformers model); None: such a call is refused, and the LightningModule uses lit_mesh.loss_of
    calls: Callable[[nn.Module], None] | None = None


@dataclass(frozen=True)
class ContextPlan:
    """Context parallelism (and the positions pipeline stages need under sequence parallelism).

    attention: the module inside every block whose forward calls F.scaled_dot_product_attention on
               (batch, heads, sequence, head_dim) tensors: context parallel swaps that call ("" : none).
    positions: the keyword of the model's forward that takes the global positions (T,) of its tokens:
               context parallel passes each rank's, and pipeline stages after the first get them under
               sequence parallelism (their input is a sequence shard) ("" : none; cp > 1 then is refused).
    swap:      how the attention is swapped. None: a TorchFunctionMode sends the `attention` module's
               F.scaled_dot_product_attention call to the cp style. A function (model, {attention module:
               ContextParallelAttention}) for models that choose their attention by name (transformers' attention
               interface: lit_mesh/hf/context.py); it sends each module's attention to `attend` of its value.
    positions_batched: the positions keyword takes (1, T) (transformers' position_ids), not (T,).
    unavailable: why this model cannot be context-parallelised and how to fix that; cp > 1 then fails with
               this message at setup ("" : nothing stands in the way).
    """

    attention: str = ""
    positions: str = ""
    swap: Callable[[nn.Module, Mapping[nn.Module, Any]], None] | None = None
    positions_batched: bool = False
    unavailable: str = ""


@dataclass(frozen=True)
class MoEPlan:
    """Mixture of experts: where the MoE layers are, for expert parallelism.

    layer:      name, inside a block, of its MoE layer (blocks without one are dense). The layer has
                `experts` (stacked weights, n_experts first) and `dispatcher`, which expert parallel swaps; the
                layer calls `dispatcher.combine(experts, tokens, token_index, weights, tokens_per_expert)` for
                each token's weighted sum of its experts' outputs, `global_load` and `mean_probs` (zoo/moe.py's
                LocalDispatch), and does so last (the checkpoint's recompute stops before the combine).
    ep_divides: sizes that the ep degree must divide, by name (number of experts).
    adapter:    for an MoE layer without `experts`/`dispatcher` of that kind (transformers' Mixtral): a
                function called on every MoE layer before anything else is applied, on every layout, that
                makes it so in place (lit_mesh/hf/mixtral.py). None: the layer already is.
    hidden_dims: expert tensor parallel: for each stacked expert weight, the dim that runs over the experts'
                hidden units; with tp > 1 it is split over tp (w1/w3 by output, w2 by input: the tp ranks' outputs
                are summed). Empty: the experts are replicated over tp.
    packed:     weights in hidden_dims whose hidden dim stacks two halves ([gate; up]): each tp rank takes its
                slice of each half.
    balancing_under_pp: the layers' balancing loss is carried through the pipeline's micro-batches: under pp the
                layer also gives `local_load`, `mean_probs`, `aux_loss_of` and `use_load` (see
                lit_mesh/parallel/pipeline/moe.py; zoo/moe.py's MoE has them). False: the model adds no balancing
                loss under pp (transformers' Mixtral: its router aux loss is refused there,
                lit_mesh/hf/pipelined_call.py).
    token_wise: the modules of the MoE layer outside `experts` (names inside the layer: router, shared experts),
                each applied token by token to (tokens, dim) inputs. With expert_tp=1 (whole experts, each tp rank
                routing its own sequence shard) they run on this rank's tokens with their weights replicated over tp
                (TP style "token_wise"); every parameter outside `experts` must lie in one. Empty: expert_tp=1 is
                refused for this model.
    """

    layer: str
    ep_divides: Mapping[str, int] = field(default_factory=dict)
    adapter: Callable[[Any], None] | None = None
    hidden_dims: Mapping[str, int] = field(default_factory=dict)
    packed: Sequence[str] = ()
    balancing_under_pp: bool = True
    token_wise: Sequence[str] = ()


@dataclass(frozen=True)
class ParallelPlan:
    """A model's parallel layout, by module name.

    blocks: dotted path of the ModuleList of repeated blocks: the FSDP units (and what pipeline stages cut);
            "" for an nn.Sequential whose own children are the blocks (lit_mesh/parallel/pipeline/sequential.py).
    init:   (parameter-name glob, Init) rules, first match wins: how each parameter starts, so a sharded
            model materialised on many ranks equals the single-device one. Empty: the model's own init.
    tp, pp, cp: what tensor, pipeline and context parallelism need; the defaults declare nothing.
    moe:    the MoE layers (None: a dense model).
    """

    blocks: str
    init: Sequence[tuple[str, Init]] = ()
    tp: TensorPlan = field(default_factory=TensorPlan)
    pp: PipelinePlan = field(default_factory=PipelinePlan)
    cp: ContextPlan = field(default_factory=ContextPlan)
    moe: MoEPlan | None = None


@dataclass
class PlanOwner:
    """A module that declares a ParallelPlan, with its name inside the LightningModule."""

    name: str
    module: nn.Module
    plan: ParallelPlan


# A plan source: for a module that has no parallel_plan() method, a function giving its plan, or None when
# the source does not know the module (lit_mesh.hf registers one for transformers models).
PlanSource = Callable[[nn.Module], Callable[[], ParallelPlan] | None]
_PLAN_SOURCES: list[PlanSource] = []


def register_plan_source(source: PlanSource) -> None:
    """Consult `source` for modules without a parallel_plan() method (once per source, in registration order)."""
    if source not in _PLAN_SOURCES:
        _PLAN_SOURCES.append(source)


def declared_plan(module: nn.Module) -> Callable[[], ParallelPlan] | None:
    """The function that gives `module`'s parallel plan, or None.

    The function that gives `module`'s plan: its parallel_plan() method, else a registered source's; None
    for a module without a plan.
    """
    declare = getattr(module, "parallel_plan", None)
    if callable(declare):
        return declare
    for source in _PLAN_SOURCES:
        found = source(module)
        if found is not None:
            return found
    return None
