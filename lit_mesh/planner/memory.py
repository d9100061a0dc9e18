"""Per-rank memory of a layout: parameters, gradients and AdamW state exactly as lit_mesh shards them
(checked against the real sharding by lit_mesh.planner.simulate), activations and transient buffers by formula.

Exact sharding rules, the ones torch applies under lit_mesh.parallel:
- TP (DTensor Shard): colwise / head / an embedding's rows split dim 0 over tp, rowwise splits dim 1, the rest
  is replicated; a split gives rank t `torch.chunk`'s t-th piece (pieces of ceil(n / tp), the last ones short).
- FSDP2 then splits dim 0 of each rank's tp piece over dp_shard x cp the same way (DDP: no split).
- A pipeline rank holds the blocks of its stages (lit_mesh's balanced split of pp x v stages, placed by the
  schedule: lit_mesh.planner.pipeline_model.rank_stages), plus the embedding (first stage) and the final norm and
  head (last stage: rank pp - 1 when looped, rank 0 in a V).
- ZeRO stages 1 and 2 (zero_stage < 3) shard the same way, and keep every unit's gathered copy from the first
  forward to the last backward of a step (buffers); stage 1 accumulates whole gradients over micro-batches.
- MoE experts (stacked (E, ...) weights) skip TP's styles: EP splits dim 0 over ep (the innermost ranks of
  dp_shard x cp), expert tensor parallel splits each expert's hidden dim over tp, then FSDP2 splits dim 1 (dim 2
  where tp holds dim 1) over the remaining expert_dp = dp_shard x cp / ep ranks (lit_mesh/parallel/expert.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache, partial

from lit_mesh.loss import CHUNK_ROWS
from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.cache import IdentityCache, by_identity
from lit_mesh.planner.pipeline_model import (
    ONE_F_ONE_B,
    RankStages,
    Schedule,
    held_blocks,
    held_gradients,
    rank_stages,
    regathers,
)
from lit_mesh.planner.shapes import ModelShapes, ParamShape
from lit_mesh.planner.vocabulary import AC_MODES, PRECISION_BYTES, ac_mode, ac_others  # noqa: F401  (re-exported)


def chunk(n: int, parts: int, index: int) -> int:
    """Length of torch.chunk(range(n), parts)[index] (0 when torch makes fewer pieces)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


ROWWISE = ("rowwise", "embedding", "embedding_whole_output")  # the plan styles that are torch's RowwiseParallel


def local_numel(p: ParamShape, tp: int, tp_rank: int, shard: int, shard_rank: int, ep: int = 1) -> int:
    """Elements of `p` on the rank at (tp_rank, shard_rank of dp_shard x cp); ep ranks are the innermost of those."""
    shape = list(p.shape)
    dim: int | None  # the dim a split runs over (None: tp leaves a bias whole)
    if p.expert and p.whole_under_tp:  # ep: the innermost ranks of dp_shard x cp x tp; FSDP over the rest
        position, shards = shard_rank * tp + tp_rank, shard * tp // ep
        shape[0] = chunk(shape[0], ep, position % ep)
        if shards > 1:
            shape[1] = chunk(shape[1], shards, position // ep)
        return _prod(shape)
    if p.expert:
        shape[0] = chunk(shape[0], ep, shard_rank % ep)
        if tp > 1 and p.hidden_dim is not None:
            shape[p.hidden_dim] = chunk(shape[p.hidden_dim], tp, tp_rank)
        if shard // ep > 1:
            dim = expert_fsdp_dim(p, tp)
            shape[dim] = chunk(shape[dim], shard // ep, shard_rank // ep)
        return _prod(shape)
    if tp > 1 and p.tp_style in ("colwise", "head", "vocab_head", *ROWWISE):
        torch_rowwise = p.tp_style in ROWWISE
        if len(shape) == 1:  # a bias: split with the colwise output, replicated under rowwise
            dim = None if torch_rowwise else 0
        elif p.is_embedding:  # nn.Embedding (vocab, dim): rowwise splits the vocabulary
            dim = 0 if torch_rowwise else 1
        else:  # nn.Linear (out, in)
            dim = 1 if torch_rowwise else 0
        if dim is not None:
            shape[dim] = chunk(shape[dim], tp, tp_rank)
    if shard > 1:
        shape[0] = chunk(shape[0], shard, shard_rank)
    return _prod(shape)


def expert_fsdp_dim(p: ParamShape, tp: int) -> int:
    """The dim FSDP2 shards an expert weight by: 1, or 2 where expert tensor parallel splits dim 1."""
    return 2 if tp > 1 and p.hidden_dim == 1 else 1


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def unsharded_numel(p: ParamShape, layout: MeshLayout) -> int:
    """Elements of `p` that FSDP gathers on a rank: its tp piece (an expert weight: its ep piece)."""
    return local_numel(p, 1 if p.whole_under_tp else layout.tp, 0, layout.ep if p.expert else 1, 0, layout.ep)


@dataclass(frozen=True)
class RankCoords:
    pp: int = 0
    dp_replicate: int = 0
    dp_shard: int = 0
    cp: int = 0
    tp: int = 0


def coords_of(rank: int, layout: MeshLayout) -> RankCoords:
    """Mesh coordinates of a global rank (dims pp, dp_replicate, dp_shard, cp, tp, the last fastest)."""
    out = {}
    for dim in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
        size = getattr(layout, dim)
        out[dim], rank = rank % size, rank // size
    return RankCoords(**out)


def fsdp_degree(layout: MeshLayout) -> int:
    return layout.dp_shard * layout.cp


def expert_fsdp_degree(shapes: ModelShapes, layout: MeshLayout) -> int:
    """The ranks FSDP shards an expert weight over: dp_shard x cp / ep (x tp with whole experts under tp)."""
    return fsdp_degree(layout) * (layout.tp if shapes.whole_experts else 1) // layout.ep


def state_numel(shapes: ModelShapes, layout: MeshLayout, rank: int = 0, *, schedule: Schedule = ONE_F_ONE_B) -> int:
    """Elements of the parameter shards global rank `rank` holds (gradients and AdamW moments: the same)."""
    c = coords_of(rank, layout)
    shard, shard_rank = fsdp_degree(layout), c.dp_shard * layout.cp + c.cp  # dp_shard_cp: dp_shard-major
    local = lambda params: sum(local_numel(p, layout.tp, c.tp, shard, shard_rank, layout.ep) for p in params)  # noqa: E731
    stages = rank_stages(shapes.n_blocks, layout.pp, schedule)[c.pp]
    n = stages.total_blocks * local(shapes.block)  # every block has the same shapes
    if stages.first:
        n += local(shapes.first)
    if stages.last:
        n += local(shapes.last)
    return n


def state_bytes(
    shapes: ModelShapes, layout: MeshLayout, precision: str, rank: int = 0, *, schedule: Schedule = ONE_F_ONE_B
) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW exp_avg + exp_avg_sq on global rank `rank`."""
    n = state_numel(shapes, layout, rank, schedule=schedule)
    b = PRECISION_BYTES[precision]
    return {"params": n * b["param"], "grads": n * b["grad"], "optimizer": n * b["optimizer"]}


def first_rank_of_stage(layout: MeshLayout, stage: int) -> int:
    """Rank 0 of each stage holds the largest torch.chunk pieces: the worst rank of that stage."""
    return stage * (layout.world_size // layout.pp)


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes, and in what pieces.

    micro_batch: sequences one data-parallel rank runs forward/backward at once. With pp > 1 the schedule runs
    local_batch / micro_batch micro-batches per step; with pp = 1 Lightning accumulates that many batches
    (accumulate_grad_batches).
    """

    global_batch: int  # sequences per optimizer step
    seq_len: int
    micro_batch: int = 1

    def local_batch(self, layout: MeshLayout) -> int:
        return self.global_batch // layout.dp

    def microbatches(self, layout: MeshLayout) -> int:
        return max(1, self.local_batch(layout) // self.micro_batch)

    def tokens_per_microbatch(self, layout: MeshLayout) -> int:
        """Tokens of one micro-batch on one rank (cp splits each sequence)."""
        return self.micro_batch * self.seq_len // layout.cp


NORM_BYTES = 4  # torch's composite rms_norm (CPU) computes in fp32: the input and normalized tensors it keeps are fp32


def _norm_elements(h: float, tp: int, act_bytes: int, fused_norm: bool, regathered: bool = False) -> float:
    """What one RMSNorm keeps per token, in elements of act_bytes: its output, the column-parallel linears' input
    (whole: all-gathered under tp; `regathered`: only its sequence shard, which backward gathers again,
    lit_mesh/parallel/regather.py), and, on its sequence shard, CUDA's fused kernel its input and fp32 1/rms, the
    composite one (CPU) its input and normalized tensor in fp32."""
    rms = 4 / act_bytes / tp
    kept = h / tp if fused_norm else 2 * h / tp * NORM_BYTES / act_bytes
    return kept + (h / tp if regathered else h) + rms


def block_activation_elements_per_token(
    shapes: ModelShapes,
    tp: int,
    ac: str,
    act_bytes: int = 4,
    fused_norm: bool = True,
    regathered: bool = True,
    ep: int = 1,
) -> float:
    """Elements (of act_bytes each) one block keeps for backward per token of this rank's sequence (flash-style
    attention: no T x T scores), as counted on a real step (lit_mesh.planner.fake_step).
    - each norm keeps its output, the input of the column-parallel linears (whole: all-gathered under tp; without
      AC only its sequence shard, `regathered` in backward: lit_mesh/parallel/regather.py), and on
      its sequence shard (/tp) its input and 1/rms (CUDA's fused kernel, the planner's default) or its input and
      normalized tensor in fp32 (the composite kernel on CPU, where lit_mesh.planner.fake_step counts);
    - attention: roped q and k, v (grouped K/V heads, not repeated), the output and its fp32 log-sum-exp;
    - feed-forward: w1, w3, silu and product outputs (/tp).
    Selective AC (lit_mesh.parallel.activation_checkpointing) keeps the block's input, wq, wk, wv, the attention
    output, w1, w3 (/tp), under tp the two reduce-scattered tensors (neither the all-gathered norm outputs nor the
    row-parallel partial sums, both whole size), without tp wo's and w2's outputs; full AC only the block's input.
    An MoE block routes the whole sequence on every tp rank (not /tp): per token the router scores, and per
    routed copy (top_k of them, plus each shared expert) the gathered input, w1 / w3 / silu / product outputs
    (/tp for the routed experts under expert tensor parallel), the expert output and its weighted copy; selective
    AC keeps of these the router scores and each copy's w1, w3 and w2 outputs (the MoE block has no dense w2), and
    under ep > 1 the dispatch's output too: the routed copies a rank receives, each with its router weight as one
    more column (balanced: top_k per token); not the combine's (lit_mesh/parallel/expert_combine.py); by node
    (ep_dispatch="by_node") also the tokens received between nodes, once per node they went to, and the table of the
    assignments (3 float32 per routed copy). With whole
    experts under tp (expert_tp=1) the MoE block routes this rank's sequence shard: its norm output is not gathered
    and every MoE term is /tp, each expert whole."""
    c = shapes.config
    h, q, kv = c.dim, c.n_heads * c.attention_head_dim, c.n_kv_heads * c.attention_head_dim
    lse = c.n_heads / tp * 4 / act_bytes
    norms = _norm_elements(h, tp, act_bytes, fused_norm, regathered)
    # the second norm's output: gathered for the feed-forward (or the whole-sequence MoE), not for whole experts
    norms += _norm_elements(h, tp, act_bytes, fused_norm, regathered or shapes.whole_experts)
    attention = (2 * q + 2 * kv) / tp + lse
    # selective under tp keeps neither the all-gathered norm outputs nor the row-parallel partial sums (whole
    # size): their reduce-scattered shards; without tp wo's and w2's outputs are plain matmul outputs, kept
    row_outputs = 0 if tp > 1 else (1 if shapes.is_moe else 2) * h
    reduce_scattered = ((1 if shapes.is_moe else 2) * h if tp > 1 else 0) / tp  # attention's, the dense FFN's
    kept = (h + 2 * q + 2 * kv) / tp + reduce_scattered + lse  # input, wq, attention, wk, wv
    if shapes.is_moe:
        copies = c.top_k + c.n_shared_experts
        hidden = c.top_k * c.expert_hidden / (tp if shapes.expert_tp else 1) + c.n_shared_experts * c.expert_hidden
        ffn, ffn_matmul_outputs, ffn_tp = (
            c.n_experts + copies * 3 * h + 4 * hidden,
            # router scores, each copy's w2 output, and under expert tp each routed copy's sum over tp (its
            # all-reduce: the partial w2 outputs are plain tensors, which the policy cannot tell partial)
            c.n_experts
            + copies * h
            + 2 * hidden
            + (c.top_k * h if tp > 1 and shapes.expert_tp else 0)
            + (c.top_k * (h + 1) if ep > 1 else 0)
            # by node: the tokens received from the other nodes (once per node) and the assignments' table
            + (shapes.nodes_per_token * h + c.top_k * 12 / act_bytes if ep > 1 and shapes.ep_nodes > 1 else 0),
            tp if shapes.whole_experts else 1,  # whole experts: this rank routes 1/tp of the tokens
        )
    else:
        f = c.ffn_hidden
        ffn, ffn_matmul_outputs, ffn_tp = 4 * f, 2 * f, tp  # w1, w3, silu and product outputs
    if ac == "none":
        return norms + attention + ffn / ffn_tp
    if ac == "selective":
        return row_outputs + kept + ffn_matmul_outputs / ffn_tp
    return h / tp  # full: only each block's input


def activation_bytes(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    precision: str,
    ac: str,
    stage: int,
    *,
    schedule: Schedule = ONE_F_ONE_B,
) -> int:
    """Activations pp rank `stage` holds at its peak: what the forward keeps for backward plus backward's
    transients (activation_parts)."""
    return sum(activation_parts(shapes, layout, work, precision, ac, stage, schedule=schedule).values())


def stage_activations(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    precision: str,
    ac: str,
    stages: RankStages,
    regathered: bool,
    fused_norm: bool = True,
    cp_style: str = "ring",
) -> tuple[float, ...]:
    """Bytes per token one micro-batch through each local stage keeps for backward: its blocks, the ones AC
    checkpoints ("full/2": the model's every 2nd) at their mode's count, the others at their own mode's (none's, or
    under "full/2+selective" selective's)."""
    mode, others = ac_mode(ac), ac_others(ac)
    per_block = _per_block_bytes(shapes, layout, work.micro_batch, precision, ac, regathered, fused_norm, cp_style)
    return tuple(
        (n - c) * per_block[others] + c * per_block[mode]
        for n, c in zip(stages.blocks, stages.checkpointed(ac), strict=True)
    )


_PER_BLOCK_CACHE: IdentityCache = {}


def _per_block_bytes(
    shapes: ModelShapes,
    layout: MeshLayout,
    micro_batch: int,
    precision: str,
    ac: str,
    regathered: bool,
    fused_norm: bool,
    cp_style: str,
) -> dict[str, float]:
    """Bytes per token one block keeps, by the AC modes `ac` gives its blocks (cached)."""

    def count() -> dict[str, float]:
        b = PRECISION_BYTES[precision]["activation"]
        per_block = {
            m: _block_elements(shapes, layout.tp, m, b, fused_norm, regathered, layout.ep) * b
            for m in {ac_others(ac), ac_mode(ac)}
        }
        for m in per_block:
            if b < 4:  # each block casts RoPE's cos and sin (T x head_dim in all) to the compute dtype
                per_block[m] += shapes.config.attention_head_dim / micro_batch * b
            if m == "selective" and layout.cp > 1 and cp_style == "ring":  # the ring's blocks (activation_parts)
                heads = shapes.config.n_heads / layout.tp
                per_block[m] += (layout.cp - 1) * heads * (shapes.config.attention_head_dim * b + 4)
        return per_block

    key = (layout.tp, layout.ep, layout.cp, micro_batch, precision, ac, regathered, fused_norm, cp_style)
    return by_identity(_PER_BLOCK_CACHE, shapes, key, count)


# block_activation_elements_per_token by shapes, tp, AC, bytes, fused norm, re-gathered and ep: the search asks for
# every option and pp rank
_BLOCK_CACHE: IdentityCache = {}


def _block_elements(
    shapes: ModelShapes, tp: int, ac: str, act_bytes: int, fused_norm: bool, regathered: bool, ep: int
) -> float:
    return by_identity(
        _BLOCK_CACHE,
        shapes,
        (tp, ac, act_bytes, fused_norm, regathered, ep),
        lambda: block_activation_elements_per_token(shapes, tp, ac, act_bytes, fused_norm, regathered, ep),
    )


def _every_block_alike(stages: RankStages, ac: str) -> bool:
    """Whether AC checkpoints all of the rank's blocks or none of them (else "full/2" mixes two kinds)."""
    checkpointed = stages.checkpointed(ac)
    return not any(checkpointed) or checkpointed == stages.blocks


def held_activations(
    schedule: Schedule, pp: int, microbatches: int, rank: int, stages: RankStages, ac: str, weights: tuple[float, ...]
) -> float:
    """held_blocks of the stages' activations (stage_activations); where every block keeps the same, the cached
    replay of the block counts times one block's (the search asks this for every option)."""
    if _every_block_alike(stages, ac):
        return held_blocks(schedule, pp, microbatches, rank, stages.blocks) * sum(weights) / stages.total_blocks
    return held_blocks(schedule, pp, microbatches, rank, weights)


def activation_parts(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    precision: str,
    ac: str,
    stage: int,
    *,
    schedule: Schedule = ONE_F_ONE_B,
    fused_norm: bool = True,
    cp_style: str = "ring",
) -> dict[str, int]:
    """held: what the forward keeps for backward on pp rank `stage`: the schedule's stage forwards in flight
    (1F1B: up to pp - stage micro-batches), each through its own stage's blocks (lit_mesh.planner.pipeline_model
    .held_blocks; under "full/2" each stage's checkpointed blocks weigh as full AC's, the others as none's), each
    micro-batch of T/cp tokens per rank (cp shards every micro-batch's sequence, with pp too), and on the last stage
    the final norm's tensors and the logits the chunked loss keeps (under tp the embedding's reduce-scattered
    output is block 0's input and the head's gathered input the final norm's whole output: each counted there,
    once). backward: what backward adds at its peak: full
    AC's recomputed block (everything once), else without AC under tp one re-gathered region input; the logits'
    gradient and one fp32 chunk of rows (lit_mesh/loss.py).
    fused_norm: the norms' kernel (block_activation_elements_per_token): CUDA's fused one (the planner's), or the
    composite one a CPU step runs.
    The CP ring under selective AC: the AC keeps the output and log-sum-exp of each of the ring's cp attention
    blocks (its recomputed forward runs the ring again, lit_mesh/parallel/context/attention.py); the causal,
    load-balanced ring gives the last cp rank, the worst, cp blocks of all its rows: cp - 1 outputs more than the
    one attention output counted per block."""
    b = PRECISION_BYTES[precision]["activation"]
    tokens = work.tokens_per_microbatch(layout)
    stages = rank_stages(shapes.n_blocks, layout.pp, schedule)[stage]
    regathered = regathers(schedule, layout.pp)
    mode, checkpointed = ac_mode(ac), stages.checkpointed(ac)
    weights = stage_activations(shapes, layout, work, precision, ac, stages, regathered, fused_norm, cp_style)
    per_token = held_activations(schedule, layout.pp, work.microbatches(layout), stage, stages, ac, weights)
    transient = 0.0
    if mode == "full" and any(checkpointed):  # the block being recomputed holds everything once (and re-gathers
        # nothing)
        transient += block_activation_elements_per_token(shapes, layout.tp, "none", b, fused_norm, False) * b
    elif sum(checkpointed) < stages.total_blocks and ac_others(ac) == "none" and layout.tp > 1 and regathered:
        transient += shapes.config.dim * b  # backward of a block without AC re-gathers one region's input at a time
    extra = 0.0
    if stages.last:
        # the logits of one micro-batch, kept by the chunked loss for its backward, and their gradient
        # (lit_mesh/loss.py), sharded over the vocabulary without pp ("vocab_head"; a pipeline stage gathers
        # them); plus one fp32 chunk of rows
        vocab = shapes.config.vocab_size / (layout.tp if layout.pp == 1 else 1)
        # and the final norm's tensors
        per_token += (vocab + _norm_elements(shapes.config.dim, layout.tp, b, fused_norm)) * b
        if layout.tp > 1:  # the final norm's output on its sequence shard, which the head's gather keeps
            per_token += shapes.config.dim / layout.tp * b
        transient += vocab * b
        extra = min(CHUNK_ROWS, tokens) * vocab * 4
    return {"held": int(tokens * per_token), "backward": int(tokens * transient + extra)}


_BLOCK_NUMEL_CACHE: IdentityCache = {}


def block_numel(shapes: ModelShapes, layout: MeshLayout) -> int:
    """Elements FSDP gathers for one block on a rank (unsharded_numel summed; cached)."""
    return by_identity(
        _BLOCK_NUMEL_CACHE, shapes, (layout,), lambda: sum(unsharded_numel(p, layout) for p in shapes.block)
    )


def buffer_bytes(
    shapes: ModelShapes, layout: MeshLayout, precision: str, stage: int, *, schedule: Schedule = ONE_F_ONE_B
) -> int:
    """FSDP2's transient unsharded copies in the compute dtype: without pp two blocks' parameters (computing +
    prefetched); under pp every block of the rank's stages (lit_mesh.parallel.data keeps them gathered from the
    first forward to the schedule's last backward); the stage roots' (embedding / head, kept from forward to
    backward); without pp plus one block's unsharded fp32 gradient before its reduce-scatter (under pp:
    accumulated_grad_bytes, which depends on the micro-batches). Nothing without sharding."""
    if fsdp_degree(layout) == 1:
        return 0
    gather = PRECISION_BYTES[precision]["gather"]
    block = block_numel(shapes, layout)
    stages = rank_stages(shapes.n_blocks, layout.pp, schedule)[stage]
    gathered = stages.total_blocks if layout.pp > 1 else 2
    root = [*(shapes.first if stages.first else ()), *(shapes.last if stages.last else ())]
    root_numel = sum(unsharded_numel(p, layout) for p in root)
    reduced = block * 4 if layout.pp == 1 else 0  # under pp: accumulated_grad_bytes
    return int(gathered * block * gather + root_numel * gather + reduced)


def accumulated_grad_bytes(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    precision: str,
    stage: int,
    *,
    schedule: Schedule = ONE_F_ONE_B,
) -> int:
    """Under pp with FSDP: the unsharded gradients of pp rank `stage`'s blocks and roots. torch's pipeline stage
    runs each backward but the last without gradient sync (stage.backward_maybe_with_nosync), so FSDP2 accumulates
    them unsharded, in its reduce dtype (fp32 under bf16-mixed), each local stage's from its first backward to the
    reduce after its last (pipeline_model.held_gradients)."""
    sizes = stage_gradient_numels(shapes, layout, stage, schedule)
    return _held_gradient_bytes(sizes, layout, work, precision, stage, schedule)


def _held_gradient_bytes(
    sizes: tuple[int, ...], layout: MeshLayout, work: Workload, precision: str, stage: int, schedule: Schedule
) -> int:
    if not sizes:
        return 0
    held = held_gradients(schedule, layout.pp, work.microbatches(layout), stage, sizes)
    return int(held * PRECISION_BYTES[precision]["grad"])


def stage_gradient_numels(shapes: ModelShapes, layout: MeshLayout, stage: int, schedule: Schedule) -> tuple[int, ...]:
    """Unsharded gradient elements of each local stage of pp rank `stage` under pp with FSDP (else none)."""
    if fsdp_degree(layout) == 1 or layout.pp == 1:
        return ()
    stages = rank_stages(shapes.n_blocks, layout.pp, schedule)[stage]
    block = block_numel(shapes, layout)
    sizes = [blocks * block for blocks in stages.blocks]  # per local stage, ascending: the embedding's is the first
    if stages.first:
        sizes[0] += sum(unsharded_numel(p, layout) for p in shapes.first)
    if stages.last:  # the head's stage: a rank's last (looped) or first (V: rank 0 holds stages 0 and 2pp - 1)
        sizes[-1] += sum(unsharded_numel(p, layout) for p in shapes.last)
    return tuple(sizes)


def zero_stage_bytes(shapes: ModelShapes, layout: MeshLayout, work: Workload, precision: str) -> dict[str, int]:
    """ZeRO-1/2 (pp = 1): every unit's parameters gathered (compute dtype) from the first forward to the last
    backward plus one block's unsharded fp32 gradient before its reduce-scatter (buffers); ZeRO-1 with several
    micro-batches also holds the whole gradients it accumulates (grads)."""
    gathered = sum(unsharded_numel(p, layout) for p in (*shapes.first, *shapes.last))
    block = sum(unsharded_numel(p, layout) for p in shapes.block)
    gathered += shapes.n_blocks * block
    return {
        "buffers": int(gathered * PRECISION_BYTES[precision]["gather"] + block * 4),
        "accumulated_grads": gathered * PRECISION_BYTES[precision]["grad"],
    }


def stages_to_check(shapes: ModelShapes, pp: int, *, schedule: Schedule = ONE_F_ONE_B) -> list[int]:
    """pp ranks whose state can be the worst: the first rank of each (blocks, embedding, head) holding."""
    first_with: dict[tuple, int] = {}
    for rank, stages in enumerate(rank_stages(shapes.n_blocks, pp, schedule)):
        first_with.setdefault((stages.total_blocks, max(stages.blocks), stages.first, stages.last), rank)
    return sorted(first_with.values())


def ranks_to_check(
    shapes: ModelShapes,
    pp: int,
    schedule: Schedule,
    microbatches: int,
    ac: str,
    activations: Callable[[RankStages], tuple[float, ...]],
) -> list[int]:
    """pp ranks whose memory can be the worst: of the ranks with the same holding (blocks, and under "full/2" the
    checkpointed ones), the one that keeps the most activations at its peak (1F1B: the first; ZBV: the last).
    `activations(stages)`: what one micro-batch through each local stage keeps (stage_activations), asked only
    where a rank mixes checkpointed and other blocks (else the cached block counts rank them)."""
    alike = _ranks_by_block_counts(shapes.n_blocks, pp, schedule, microbatches, ac)
    if alike is not None:
        return list(alike)
    worst: dict[tuple, tuple[float, int]] = {}  # holding -> (held activations, rank)
    for rank, stages in enumerate(rank_stages(shapes.n_blocks, pp, schedule)):
        key = (stages.blocks, stages.first, stages.last, stages.checkpointed(ac))
        held = held_blocks(schedule, pp, microbatches, rank, activations(stages))
        if key not in worst or held > worst[key][0]:
            worst[key] = (held, rank)
    return sorted(rank for _, rank in worst.values())


@lru_cache(maxsize=65536)  # the search asks for every option
def _ranks_by_block_counts(
    n_blocks: int, pp: int, schedule: Schedule, microbatches: int, ac: str
) -> tuple[int, ...] | None:
    """ranks_to_check where every rank's blocks are alike under `ac` (all checkpointed or none), so that block
    counts rank them; None where a rank mixes them."""
    every_rank = rank_stages(n_blocks, pp, schedule)
    if not all(_every_block_alike(stages, ac) for stages in every_rank):
        return None
    worst: dict[tuple, tuple[float, int]] = {}  # holding -> (held blocks, rank)
    for rank, stages in enumerate(every_rank):
        key = (stages.blocks, stages.first, stages.last)
        held = held_blocks(schedule, pp, microbatches, rank, stages.blocks)
        if key not in worst or held > worst[key][0]:
            worst[key] = (held, rank)
    return tuple(sorted(rank for _, rank in worst.values()))


# (state bytes, FSDP buffer bytes, gradient sizes) per rank: none depends on the micro-batch or AC, which the search
# varies
_STATE_CACHE: IdentityCache = {}


def _cached_state(
    shapes: ModelShapes, layout: MeshLayout, precision: str, stage: int, schedule: Schedule
) -> tuple[dict[str, int], int, tuple[int, ...]]:
    def count() -> tuple[dict[str, int], int, tuple[int, ...]]:
        rank = first_rank_of_stage(layout, stage)
        state = state_bytes(shapes, layout, precision, rank, schedule=schedule)
        buffers = buffer_bytes(shapes, layout, precision, stage, schedule=schedule)
        return state, buffers, stage_gradient_numels(shapes, layout, stage, schedule)

    return by_identity(_STATE_CACHE, shapes, (layout, precision, stage, schedule), count)


_FULLEST_CACHE: IdentityCache = {}


def fullest_state_numel(shapes: ModelShapes, layout: MeshLayout, schedule: Schedule = ONE_F_ONE_B) -> int:
    """The most parameter elements any rank holds (the optimizer step's work), cached: the search asks once per
    micro-batch and AC mode for the same layout."""
    return by_identity(
        _FULLEST_CACHE,
        shapes,
        (layout, schedule),
        lambda: max(
            state_numel(shapes, layout, first_rank_of_stage(layout, r), schedule=schedule)
            for r in stages_to_check(shapes, layout.pp, schedule=schedule)
        ),
    )


def rank_memory(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    precision: str,
    ac: str,
    zero_stage: int = 3,
    *,
    schedule: Schedule = ONE_F_ONE_B,
) -> dict[str, int]:
    """The worst pp rank's bytes by component (the first rank of each pp slice holds the most); "stage" names it."""
    worst: dict[str, int] = {}
    regathered = regathers(schedule, layout.pp)
    activations = partial(stage_activations, shapes, layout, work, precision, ac, regathered=regathered)
    for stage in ranks_to_check(shapes, layout.pp, schedule, work.microbatches(layout), ac, activations):
        state, buffers, grad_numels = _cached_state(shapes, layout, precision, stage, schedule)
        m = dict(state)
        m["activations"] = activation_bytes(shapes, layout, work, precision, ac, stage, schedule=schedule)
        # under pp: the unsharded gradients held through the schedule (accumulated_grad_bytes)
        m["buffers"] = buffers + _held_gradient_bytes(grad_numels, layout, work, precision, stage, schedule)
        if zero_stage < 3 and fsdp_degree(layout) > 1:
            zero = zero_stage_bytes(shapes, layout, work, precision)
            m["buffers"] = zero["buffers"]
            if zero_stage == 1 and work.microbatches(layout) > 1:
                m["grads"] = zero["accumulated_grads"]
        m["total"] = sum(m.values())
        m["stage"] = stage
        if not worst or m["total"] > worst["total"]:
            worst = m
    return worst
