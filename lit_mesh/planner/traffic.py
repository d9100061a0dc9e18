"""Bytes each collective of a training step moves on one rank, per mesh dim and operation: the planner's
communication terms, in the unit lit_mesh.comm.topology's ring formulas take (an all-gather: the gathered tensor;
a reduce-scatter: its input; an all-reduce: its tensor; an all-to-all: what this rank sends; a send: the message).

`lit-mesh plan --simulate` checks them against the collectives of a real step over the fake process group
(lit_mesh.planner.fake_step). What lit_mesh runs, per micro-batch unless said:
- fsdp (dp_shard x cp): FSDP2 gathers each unit's parameters, every tensor's dim 0 padded to a multiple of the
  shard count: the root (embedding, norm, head: kept from forward to backward) once, each block in forward and
  again in backward but the last block (lit_mesh/parallel/data.py keeps it gathered); gradients reduce-scattered
  in fp32 (bf16-true: bf16) at the last micro-batch (ZeRO-2: every one). ZeRO-1/2 and a pipeline's stages gather
  once per step. Float8 "tensorwise": the blocks' float8 linears' weights gathered in float8, after an all-reduce
  of their amax.
- expert_fsdp (dp_shard x cp / ep; dp_shard x cp x tp / ep with whole experts under tp): the expert units, resharded
  after every forward (gathered twice per block).
- dp_replicate (HSDP): the shards' gradients (the experts' too) all-reduced once per step.
- tp (1-D, sequence parallel): per block an all-gather before attention and the feed-forward and a reduce-scatter
  after each, forward and backward (full AC's recomputed forward: both gathers, the first reduce-scatter; selective's: both gathers;
  without AC backward gathers both again, lit_mesh/parallel/regather.py); the embedding's output
  reduce-scattered and the head's input gathered; the vocabulary-parallel loss all-reduces three fp32 numbers per
  token (under pp the last stage's head gathers the logits instead); the sequence-parallel norms' weight gradients
  are all-reduced.
- cp ring: a block's K/V (grouped heads, as they are) sent cp - 1 times forward and again backward (and again in
  the recomputed forward of full or selective AC: point-to-point sends are not among the ops selective AC keeps),
  plus cp sends of the fp32 dK/dV accumulator; Ulysses: one all-to-all of q, k, v and one of the output, forward and backward.
- ep: dispatch and combine of the routed copies (top_k per token of the whole micro-batch; with whole experts under
  tp, of this tp rank's sequence shard), forward and backward, plus the token counts; the dispatch sends each
  copy's router weight as one more column (the combine is weighted on the experts' rank), and full AC's recompute
  runs it again (not the combine: the recompute stops before it). Whole experts under tp also
  all-reduce over tp the router's (and shared experts') weight gradients and each forward's mean router
  probabilities, and their MoE layer gathers nothing: per block one tp region (attention), not two.
- pp: per micro-batch, each local stage receives its input and sends its output forward (but the model's first
  input and last output, and in a V the handoff between the two stages of the last pp rank), and the gradients
  the other way backward: a (micro-batch, T/cp/tp, dim) tensor each; the step's loss broadcast from the last stage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from lit_mesh.mesh import MeshLayout
from lit_mesh.parallel.pipeline.schedules import SCHEDULES
from lit_mesh.planner.cost import by_node_message_bytes, ep_message_bytes, float8_linear
from lit_mesh.planner.memory import ROWWISE, Workload, chunk, expert_fsdp_degree, fsdp_degree, unsharded_numel
from lit_mesh.planner.pipeline_model import ONE_F_ONE_B, Schedule, rank_stages, regathers
from lit_mesh.planner.shapes import ModelShapes, ParamShape
from lit_mesh.planner.vocabulary import PRECISION_BYTES, ac_mode, ac_others

Traffic = dict[str, dict[str, float]]  # mesh dim -> operation -> bytes per step on one rank


def padded_numel(p: ParamShape, layout: MeshLayout, shards: int) -> int:
    """Elements FSDP2 gathers for `p`: the rank's tp (or ep) piece with dim 0 padded to a multiple of `shards`
    (expert weights shard evenly, off dim 0: no padding)."""
    n = unsharded_numel(p, layout)
    if p.expert or shards == 1 or n == 0:
        return n
    rows = _tp_rows(p, layout.tp)
    return -(-rows // shards) * shards * (n // rows)


def _tp_rows(p: ParamShape, tp: int) -> int:
    """Dim 0 of tp rank 0's piece of `p` (lit_mesh.planner.memory.local_numel's splits)."""
    rows = p.shape[0]
    if tp == 1 or p.tp_style not in ("colwise", "head", "vocab_head", *ROWWISE):
        return rows
    rowwise = p.tp_style in ROWWISE
    if len(p.shape) == 1:
        splits_rows = not rowwise
    elif p.is_embedding:
        splits_rows = rowwise
    else:
        splits_rows = not rowwise
    return chunk(rows, tp, 0) if splits_rows else rows


def comm_bytes(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    precision: str,
    ac: str,
    *,
    zero_stage: int = 3,
    cp_style: str = "ring",
    schedule: Schedule = ONE_F_ONE_B,
    stage: int = 0,
    float8: str | None = None,
) -> Traffic:
    """The step's collectives on a rank of pp rank `stage` (module doc), by mesh dim and operation."""
    c, b = shapes.config, PRECISION_BYTES[precision]
    gather, reduce, act = b["gather"], b["grad"], b["activation"]
    out: Traffic = defaultdict(lambda: defaultdict(float))
    n_micro = work.microbatches(layout)
    stages = rank_stages(shapes.n_blocks, layout.pp, schedule)[stage]
    blocks = stages.total_blocks
    root_params = [*(shapes.first if stages.first else ()), *(shapes.last if stages.last else ())]
    dense, experts = shapes.dense_block, shapes.expert_block
    # "full/2": the checkpointed blocks of this rank's stages (the model's every 2nd) count as full AC's, the
    # others as none's ("full/2+selective": as selective's)
    mode, others = ac_mode(ac), ac_others(ac)
    checked = sum(stages.checkpointed(ac))
    plain = blocks - checked

    def over_blocks(per_block: dict[str, float]) -> float:
        """A per-block count summed over this rank's blocks, each at its own AC."""
        return plain * per_block[others] + checked * per_block[mode]

    k = fsdp_degree(layout)
    expert_k = expert_fsdp_degree(shapes, layout)
    if k > 1:
        block = sum(padded_numel(p, layout, k) for p in dense)
        root = sum(padded_numel(p, layout, k) for p in root_params)
        # float8 "tensorwise": the float8 linears' weights gathered in float8 (one byte), each gather after an
        # all-reduce of their amax (one number of the parameters' dtype per linear)
        fp8 = [p for p in dense if float8_linear(p)] if float8 == "tensorwise" else []
        block_bytes = block * gather - sum(padded_numel(p, layout, k) for p in fp8) * (gather - 1)
        gathers = blocks if zero_stage < 3 or layout.pp > 1 else n_micro * (2 * blocks - 1)  # a pipeline's and
        # ZeRO-1/2's blocks stay gathered over the step's micro-batches
        out["fsdp"]["all_gather"] += (root if zero_stage < 3 or layout.pp > 1 else n_micro * root) * gather
        out["fsdp"]["all_gather"] += gathers * block_bytes
        if fp8:
            out["fsdp"]["all_reduce"] += gathers * len(fp8) * b["param"]
        reductions = n_micro if zero_stage == 2 else 1
        out["fsdp"]["reduce_scatter"] += reductions * (root + blocks * block) * reduce
        if layout.dp_replicate > 1:
            out["dp_replicate"]["all_reduce"] += (root + blocks * block) // k * reduce
    # the experts' own FSDP group: dp_shard x cp / ep, or with whole experts under tp dp_shard x cp x tp / ep (no
    # group where ep takes every one of those ranks)
    own_group = layout.ep > 1 or shapes.whole_experts
    if experts and (expert_k if own_group else k) > 1:
        shards = expert_k if own_group else k
        name = "expert_fsdp" if own_group else "fsdp"
        numel = sum(padded_numel(p, layout, shards) for p in experts)
        passes = 1 if layout.pp > 1 else n_micro * 2  # a pipeline's stages keep their experts gathered too
        out[name]["all_gather"] += passes * blocks * numel * gather
        out[name]["reduce_scatter"] += blocks * numel * reduce
        if layout.dp_replicate > 1:  # HSDP: the experts' gradient shards all-reduced over the replicas too
            out["dp_replicate"]["all_reduce"] += blocks * numel // shards * reduce

    tokens = work.tokens_per_microbatch(layout)  # this rank's, per micro-batch (cp splits the sequence)
    if layout.tp > 1:
        hidden = tokens * c.dim * act
        regions = shapes.tp_regions  # attention and the feed-forward; with whole experts attention alone
        per_pass = regions * blocks * hidden  # forward: gathers (or reduce-scatters) per block
        ends = (1 if stages.first else 0) + (1 if stages.last else 0)  # embedding output, head input
        # full AC's recomputed forward gathers again but stops before the block's last reduce-scatter (nothing of
        # it is saved: torch's checkpoint ends the recompute early)
        # selective AC keeps no all-gather output: its recompute gathers twice again too; without AC a block keeps
        # only the shards of its two gathered inputs and gathers them again in backward (lit_mesh/parallel/regather.py)
        # unless a split backward keeps them whole
        regathered = regions if regathers(schedule, layout.pp) else 0
        again = {
            "all_gather": over_blocks({"none": regathered, "selective": regions, "full": regions}) * hidden,
            "reduce_scatter": over_blocks({"none": 0, "selective": 0, "full": 1}) * hidden,
        }
        for op in ("all_gather", "reduce_scatter"):
            out["tp"][op] += n_micro * (2 * per_pass + again[op] + ends * hidden)
        if stages.last and layout.pp > 1:  # a pipeline's head gathers the logits over the vocabulary
            out["tp"]["all_gather"] += n_micro * tokens * c.vocab_size * act
        norms = 2 * blocks + (1 if stages.last else 0)
        loss = 3 * tokens * 4 if stages.last and layout.pp == 1 else 0
        # the norms' weight gradients (partial sums over the sequence shards): under pp summed over the step's
        # micro-batches in fp32 first, then reduced once
        out["tp"]["all_reduce"] += n_micro * loss + norms * c.dim * (reduce if layout.pp > 1 else gather)
        if shapes.whole_experts:  # each tp rank routes its own tokens: the router's weight gradient (and the shared
            # experts') summed over tp, and each forward's mean router probabilities (fp32) averaged over tp
            token_wise = sum(unsharded_numel(p, layout) for p in dense if p.token_wise)
            forwards = over_blocks({"none": 1, "selective": 1, "full": 2})
            out["tp"]["all_reduce"] += blocks * token_wise * (reduce if layout.pp > 1 else gather)
            out["tp"]["all_reduce"] += n_micro * forwards * c.n_experts * 4

    if layout.cp > 1:
        kv_heads, head_dim = c.n_kv_heads // layout.tp, c.attention_head_dim
        kv = 2 * tokens * kv_heads * head_dim * act
        if cp_style == "ulysses":
            kv_heads = max(kv_heads, layout.cp)  # repeated until cp divides them
            q = tokens * c.n_heads // layout.tp * head_dim * act
            qkv = q + 2 * tokens * kv_heads * head_dim * act
            out["cp"]["all_to_all"] += n_micro * over_blocks({"none": 2, "selective": 2, "full": 3}) * (qkv + q)
        else:  # the ring's sends are no op selective AC keeps: its forward runs again under either AC
            forwards = over_blocks({"none": 2, "selective": 3, "full": 3})  # per block: 2, or 3 under either AC
            sends = forwards * (layout.cp - 1) * kv + blocks * layout.cp * kv * 4 // act
            out["cp"]["send"] += n_micro * sends
            out["cp"]["recv"] += n_micro * sends

    if layout.ep > 1:
        dispatched, routed = ep_message_bytes(shapes, layout, work, act)
        counts = c.n_experts * 8  # int64 tokens per expert, exchanged before each dispatch
        # forward passes of the dispatch: full AC's recompute runs it again, but stops before the combine
        # (lit_mesh/parallel/expert_combine.py): the combine once forward, once backward
        forwards = over_blocks({"none": 1, "selective": 1, "full": 2})
        dispatch = (forwards + blocks) * dispatched + forwards * counts
        if shapes.ep_nodes > 1:  # by node: the tokens once per node (with the assignments' table) and the partial
            # sums back between nodes ("ep:inter", one rank per node); the routed copies inside the node ("ep:intra")
            nodes = shapes.ep_nodes
            tokens_between, table = by_node_message_bytes(shapes, layout, work, act)
            inside = (forwards + blocks) * dispatched + forwards * (c.n_experts // nodes) * 8
            between = (forwards + blocks) * (tokens_between + table) + forwards * nodes * 2 * 8
            out["ep:intra"]["all_to_all"] += n_micro * (inside + 2 * blocks * routed)
            out["ep:inter"]["all_to_all"] += n_micro * (between + 2 * blocks * tokens_between)
        else:
            out["ep"]["all_to_all"] += n_micro * (dispatch + 2 * blocks * routed)

    if layout.pp > 1:
        message = tokens // layout.tp * c.dim * act  # sequence parallel: the boundary's activation is /tp
        # each local stage receives its input and sends its output, but the first and the last stage of the model
        edges = 2 * len(stages.blocks) - (1 if stages.first else 0) - (1 if stages.last else 0)
        if SCHEDULES[schedule.name][2] == "v" and stage == layout.pp - 1:  # stages pp - 1 and pp: a local handoff
            edges -= 2
        out["pp"]["send"] += n_micro * edges * message
        out["pp"]["recv"] += n_micro * edges * message
        out["pp"]["broadcast"] += 4  # the step's fp32 loss, from the last stage to every pp rank
    return {dim: dict(ops) for dim, ops in out.items()}


def merged_like(estimate: Traffic, counted_dims: Iterable[str]) -> Traffic:
    """`estimate` with the dims a real step counts as one group merged as it names them ("tp=ep": with whole experts
    under tp, ep = tp takes exactly the tp ranks; one communicator carries both dims' traffic)."""
    merged = {dim: dict(ops) for dim, ops in estimate.items()}
    for joined in (d for d in counted_dims if "=" in d):
        total: dict[str, float] = defaultdict(float)
        for part in joined.split("="):
            for op, n in merged.pop(part, {}).items():
                total[op] += n
        merged[joined] = dict(total)
    return merged
