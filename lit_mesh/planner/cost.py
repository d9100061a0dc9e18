"""Step time of a layout, in parts a reader can check: kernels by their per-rank shapes, every collective's
exposed share, the pipeline bubble of the schedule, the activation-checkpointing recompute.

Compute, per rank and micro-batch, per block:
- GEMMs: 6 M N K FLOPs (forward + backward) for each weight's tp-local (N, K), at a fraction of peak that grows
  with the GEMM's size: eff(N, K) = gemm_peak_fraction x N / (N + half) x K / (K + half) (M, the tokens of a
  micro-batch, is thousands: never the limit). A small GEMM after tp=8 is slower per FLOP than a big one.
- MoE experts: one grouped GEMM per weight, each local expert a GEMM of the rows routed to it; balanced routing
  gives every expert M = tokens x top_k x ep / n_experts rows (the ep group's routed copies over the experts), and
  a short M is what limits fine-grained experts: eff x M / (M + half), the same half-size form; dropless routing
  by a router that spreads tokens unevenly (ModelShapes.routing_cv) gives the busiest ep rank more (its experts'
  GEMMs and its all-to-alls: ModelShapes.routing_imbalance), and the step waits for it;
- MoE router: its gate GEMM is a GEMM above; its scores (fp32, tokens x n_experts: sigmoid or softmax, top-k, the
  balancing statistics) and the permutation of the routed copies into expert order and back are memory bound;
- attention (flash, causal: half the dense 12 T d FLOPs per token) at attention_peak_fraction of peak;
- norms, activations, RoPE, residuals: memory bound, elementwise_accesses bytes-per-element moved per token of
  (dim + ffn) / tp, forward + backward, over HBM bandwidth (fewer with torch.compile fusing them);
- recompute: full AC repeats the block's forward (1/3 of the above); selective (lit_mesh keeps matmul, attention,
  reduce-scatter and all-to-all outputs) repeats the elementwise forward and, under tp, the all-gathers and wo's
  row-parallel matmul (its partial sum is not kept);
- the AdamW step on the rank's shards (memory bound).
Communication, each collective with its own overlap rule (lit_mesh.comm.topology's ring alpha-beta for each):
- FSDP/HSDP: a block's all-gather (and, on the last micro-batch, its reduce-scatter and the replicas' all-reduce)
  runs while the previous block computes (prefetch depth 1, FSDP2's default): exposed only where it exceeds that
  block's compute, plus the first block's gather of each pass; ZeRO-1/2 gather once per step (forward only) and
  reduce every micro-batch (2) or once per step (1);
- TP/SP: all-gathers and reduce-scatters of the activations on the critical path (async TP: the forward's hidden,
  the backward's exposed), without AC two all-gathers more per block in backward (the re-gathered inputs);
- CP ring: each K/V block's send overlaps the attention on the previous one: exposed where the send is longer;
  under pp each stage runs the ring over its own blocks, on micro-batches of T/cp tokens per rank;
- EP: the all-to-alls of dispatch and combine (top_k copies of the micro-batch's tokens each way, forward and
  backward, in pp's routing pass, and the dispatch (each copy with its router weight) again in full AC's
  recompute): lit_mesh runs them on the compute stream
  between the router and the experts, each waiting for the one before, so they are exposed; a run that overlaps
  them with another micro-batch's compute (DualPipe, Megatron's 1F1B all-to-all overlap: Features.ep_overlap)
  exposes only what exceeds that block's compute;
- PP: the stage-boundary send/receive, exposed.
Pipeline: the bubble of the schedule (lit_mesh.planner.pipeline_model) stretches the stage's time; the slowest stage sets the pace.
The kernel constants are calibrated once against published runs: lit_mesh/planner/calibration.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from lit_mesh.comm.topology import all_gather_time, all_reduce_time
from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.cache import IdentityCache, by_identity
from lit_mesh.planner.families import family_of
from lit_mesh.planner.hardware import Hardware
from lit_mesh.planner.memory import (
    PRECISION_BYTES,
    Workload,
    expert_fsdp_degree,
    fsdp_degree,
    fullest_state_numel,
    unsharded_numel,
)
from lit_mesh.planner.pipeline_model import (  # noqa: F401  (re-exported)
    Schedule,
    bubble_fraction,
    checkpointed_share,
    rank_stages,
    regathers,
)
from lit_mesh.planner.shapes import ModelShapes, ParamShape
from lit_mesh.planner.vocabulary import ac_mode, ac_others

CALIBRATION = Path(__file__).with_name("calibration.yaml")


@dataclass(frozen=True)
class Kernels:
    """How fast the kernels run, as fractions of the hardware's peaks (one set for every run)."""

    gemm_peak_fraction: float  # what the largest bf16 GEMMs reach
    gemm_half_size: float  # an N or K of this size halves a GEMM's efficiency
    attention_peak_fraction: float  # flash attention forward + backward
    elementwise_accesses: float  # bytes per (token x (dim + ffn) / tp element) moved by the memory-bound ops, eager
    elementwise_accesses_compiled: float  # the same under torch.compile (fused)
    adamw_bytes_per_parameter: float  # the optimizer step reads and writes the fp32 shards
    float8_gemm_peak_fraction: float  # what the largest float8 GEMMs reach of the float8 peak (torchao's linears)
    float8_cast_accesses: float  # bytes moved per element of a float8 linear's input and output, forward +
    # backward: the amax reductions and the casts of the input and of the output's gradient (compiled, tensorwise)
    float8_rowwise_cast_accesses: float  # the same for rowwise scaling (a scale per row of each operand, and
    # again along the other dim for the transposed operands of backward)

    def gemm_efficiency(self, n: float, k: float, float8: bool = False) -> float:
        fraction = self.float8_gemm_peak_fraction if float8 else self.gemm_peak_fraction
        return fraction * n / (n + self.gemm_half_size) * k / (k + self.gemm_half_size)

    def grouped_gemm_efficiency(self, m: float, n: float, k: float) -> float:
        """One expert's GEMM of m routed rows: a short m (few tokens per expert) runs further from peak."""
        return self.gemm_efficiency(n, k) * m / (m + self.gemm_half_size)


@lru_cache(maxsize=1)
def calibrated_kernels() -> Kernels:
    import yaml

    return Kernels(**yaml.safe_load(CALIBRATION.read_text())["kernels"])


@dataclass(frozen=True)
class Features:
    """Switches of the run that change its speed, not its memory."""

    compile: bool = False  # torch.compile of the blocks: elementwise ops fused
    async_tp: bool = False  # tensor-parallel collectives decomposed and overlapped with their matmuls
    reshard_after_forward: bool = True  # FSDP frees gathered weights after each forward (lit_mesh); False: ZeRO-2,
    # gathered once per step and kept through every micro-batch (Llama 3's 405B run)
    schedule: Schedule = Schedule()
    zero_stage: int = 3  # 1, 2 (pp = 1): gathered once per step, no gather in backward; gradients reduced every
    # micro-batch (2) or once, at the last one (1)
    ep_overlap: bool = False  # the EP all-to-alls hidden behind another micro-batch's compute (DualPipe); lit_mesh: no
    ep_stride: int | None = None  # ranks between an EP group's members where a run places them otherwise than
    # lit_mesh (at stride tp): Megatron-Core's MoE parallel folding puts EP x expert-TP 1 on consecutive ranks (1)
    routing_pass: bool = True  # pp x MoE: lit_mesh's forward-only routing pass; a run that balances each
    # micro-batch on its own (Megatron-Core, DeepSeek) has none
    float8: str | None = None  # MeshStrategy(float8=...): "tensorwise" or "rowwise" linears in the blocks (torchao)


@dataclass
class StepTime:
    compute_parts: dict[str, float] = field(default_factory=dict)  # per step, on the slowest stage
    exposed: dict[str, float] = field(default_factory=dict)  # communication on the critical path
    overlapped: dict[str, float] = field(default_factory=dict)  # communication traffic, hidden or not (for reading)
    bubble: float = 0.0  # pipeline idle fraction of the stage's time
    optimizer: float = 0.0  # the AdamW step, after the schedule

    @property
    def compute(self) -> float:
        return sum(self.compute_parts.values())

    @property
    def total(self) -> float:
        return (self.compute + sum(self.exposed.values())) * (1 + self.bubble) + self.optimizer


_FLOPS_CACHE: IdentityCache = {}


def flops_per_token(shapes: ModelShapes, seq_len: int) -> float:
    """The model family's training FLOPs per token (an MoE's: the experts a token uses and the router; cached)."""
    return by_identity(
        _FLOPS_CACHE, shapes, (seq_len,), lambda: family_of(shapes.config).flops_per_token(shapes.config, seq_len)
    )


def model_flops_per_step(shapes: ModelShapes, work: Workload) -> float:
    return flops_per_token(shapes, work.seq_len) * work.global_batch * work.seq_len


def dim_strides(layout: MeshLayout) -> dict[str, int]:
    """Distance between neighbouring ranks of each dim's groups (tp innermost, on consecutive ranks)."""
    return {
        "tp": 1,
        "cp": layout.tp,
        "dp_shard": layout.tp * layout.cp,
        "dp_replicate": layout.tp * layout.cp * layout.dp_shard,
        "pp": layout.world_size // layout.pp,
    }


def _local_matrix(p: ParamShape, tp: int) -> tuple[int, int] | None:
    """(N, K) of the GEMM a 2-D weight does on one tp rank; None for vectors and embeddings (lookups)."""
    if len(p.shape) != 2 or p.is_embedding:
        return None
    n, k = p.shape
    if p.tp_style in ("colwise", "head", "vocab_head"):
        n = -(-n // tp)
    elif p.tp_style == "rowwise":
        k = -(-k // tp)
    return n, k


def tokens_per_expert(tokens: float, top_k: int, ep: int, n_experts: int) -> float:
    """Rows of one expert's GEMM under balanced routing: the ep group's routed copies spread over the experts."""
    return tokens * top_k * ep / n_experts


FLOAT8_PEAK_RATIO = 2  # Ada, Hopper and Blackwell: the dense float8 tensor-core peak is twice the bf16 one
FLOAT8_MULTIPLE = 16  # lit_mesh/parallel/float8.py converts the block linears whose dims are multiples of this


def float8_linear(p: ParamShape) -> bool:
    """A block weight MeshStrategy(float8=...) turns into torchao's Float8Linear: a dense linear (the experts' stacked
    weights are not nn.Linear) whose dims are multiples of 16."""
    return len(p.shape) == 2 and not p.is_embedding and not p.expert and all(d % FLOAT8_MULTIPLE == 0 for d in p.shape)


_GEMM_CACHE: IdentityCache = {}


def _gemm_seconds(
    params: tuple[ParamShape, ...],
    tokens: float,
    tp: int,
    ep: int,
    top_k: int,
    kern: Kernels,
    peak: float,
    float8: bool = False,
) -> float:
    """Forward + backward GEMM time of `tokens` tokens through these weights on one rank (`float8`: the float8
    linears at the float8 peak); cached by the weights' tuple (kernels compare by value)."""
    key = (tokens, tp, ep, top_k, kern, peak, float8)
    return by_identity(_GEMM_CACHE, params, key, lambda: _gemm_seconds_of(params, *key))


def _gemm_seconds_of(params: tuple[ParamShape, ...], *key: Any) -> float:
    tokens, tp, ep, top_k, kern, peak, float8 = key
    seconds = 0.0
    for p in params:
        if p.expert:  # (E, N, K): each token through top_k experts; ep spreads experts and their tokens evenly
            n, k = p.shape[1], p.shape[2]
            if p.hidden_dim is not None:  # expert tensor parallel: 1/tp of each expert's hidden units per rank
                n, k = (-(-n // tp), k) if p.hidden_dim == 1 else (n, -(-k // tp))
            m = tokens_per_expert(tokens, top_k, ep, p.shape[0])
            seconds += 6 * tokens * top_k * n * k / (peak * kern.grouped_gemm_efficiency(m, n, k))
            continue
        nk = _local_matrix(p, tp)
        if nk is not None:
            fp8 = float8 and float8_linear(p)
            rate = peak * (FLOAT8_PEAK_RATIO if fp8 else 1) * kern.gemm_efficiency(*nk, float8=fp8)
            seconds += 6 * tokens * nk[0] * nk[1] / rate
    return seconds


def float8_cast_seconds(
    params: tuple[ParamShape, ...], tokens: float, tp: int, recipe: str, kern: Kernels, bandwidth: float
) -> float:
    """The float8 linears' casts, forward + backward: each linear's input and output gradient (tokens x its local
    K and N) scaled and cast (the weights' casts, once per micro-batch, are negligible beside them)."""
    widths = sum(sum(_local_matrix(p, tp) or ()) for p in params if float8_linear(p))
    accesses = kern.float8_cast_accesses if recipe == "tensorwise" else kern.float8_rowwise_cast_accesses
    return tokens * widths * accesses / bandwidth


ROUTER_SCORE_ACCESSES = 12  # fp32 reads and writes of the tokens x n_experts scores, forward + backward: the gate's
# output, sigmoid / softmax, top-k, the gate weights' gather and normalisation, the balancing statistics
PERMUTE_ACCESSES = 8  # each routed copy read and written into expert order and back (2 x 2), forward and backward


def router_seconds(config: object, tokens: float, act_bytes: int, memory_bandwidth: float) -> float:
    """The memory-bound part of routing one micro-batch through one MoE block, forward + backward."""
    scores = tokens * config.n_experts * 4 * ROUTER_SCORE_ACCESSES  # type: ignore[attr-defined]
    copies = tokens * config.top_k * config.dim * act_bytes * PERMUTE_ACCESSES  # type: ignore[attr-defined]
    return (scores + copies) / memory_bandwidth


def _ffn_width(config: object) -> int:
    if hasattr(config, "expert_hidden"):  # MoE: the routed and shared experts a token passes through
        return config.expert_hidden * (config.top_k + config.n_shared_experts)  # type: ignore[attr-defined]
    return config.ffn_hidden  # type: ignore[attr-defined]


def ep_message_bytes(shapes: ModelShapes, layout: MeshLayout, work: Workload, act: int) -> tuple[int, int]:
    """Bytes of one MoE layer's dispatch and of its combine per micro-batch on a rank: top_k copies of the
    micro-batch's tokens (with whole experts under tp, of this tp rank's sequence shard); the dispatch carries each
    copy's router weight as one more column (lit_mesh/parallel/expert.py)."""
    c = shapes.config
    routed = work.micro_batch * work.seq_len // layout.cp * c.top_k * c.dim * act
    routed //= layout.tp if shapes.whole_experts else 1
    return routed * (c.dim + 1) // c.dim, routed


def by_node_message_bytes(shapes: ModelShapes, layout: MeshLayout, work: Workload, act: int) -> tuple[float, float]:
    """ep_dispatch="by_node" (shapes.ep_nodes > 1): bytes of one MoE layer's exchange between nodes per micro-batch
    on a rank: (the tokens, once per node they go to; the assignments' table: 3 float32 per routed copy). Inside the
    node the routed copies move as ep_message_bytes says (lit_mesh/parallel/expert_by_node.py)."""
    c = shapes.config
    copies = ep_message_bytes(shapes, layout, work, act)[1] / (c.dim * act)  # top_k per routed token
    return copies / c.top_k * shapes.nodes_per_token * c.dim * act, copies * 12


def ep_stride_of(shapes: ModelShapes, layout: MeshLayout, ep_stride: int | None = None) -> int:
    """Ranks between an ep group's members: a run's own placement (Features.ep_stride), else lit_mesh's: tp, 1 with
    whole experts under tp (ep takes the innermost ranks of dp_shard x cp x tp)."""
    return ep_stride or (1 if shapes.whole_experts else layout.tp)


def ep_nodes_spanned(shapes: ModelShapes, layout: MeshLayout, hw: Hardware, ep_stride: int | None = None) -> int:
    """The nodes one ep group spans (1: inside a node)."""
    nodes = max(1, ep_stride_of(shapes, layout, ep_stride) * layout.ep // hw.devices_per_node)
    return nodes if layout.ep % nodes == 0 else 1  # ranks spread unevenly over nodes: no by-node split (refused)


_GATHERED_CACHE: IdentityCache = {}


def gathered_numels(shapes: ModelShapes, layout: MeshLayout) -> tuple[int, int, int]:
    """Elements FSDP gathers per block on a rank: the dense parameters, the experts', and the float8 linears' among
    the dense ones (cached: the search prices many options of one layout)."""

    def count() -> tuple[int, int, int]:
        numel = lambda params: sum(unsharded_numel(p, layout) for p in params)  # noqa: E731
        return numel(shapes.dense_block), numel(shapes.expert_block), numel(p for p in shapes.block if float8_linear(p))

    return by_identity(_GATHERED_CACHE, shapes, (layout,), count)


def step_time(
    shapes: ModelShapes,
    layout: MeshLayout,
    work: Workload,
    precision: str,
    ac: str,
    hw: Hardware,
    features: Features = Features(),
    kernels: Kernels | None = None,
) -> StepTime:
    c, kern = shapes.config, kernels or calibrated_kernels()
    if hw.compute_efficiency is not None:  # the user's own figure for the largest GEMMs
        kern = Kernels(**{**kern.__dict__, "gemm_peak_fraction": hw.compute_efficiency})
    bytes_of, stride, peak = PRECISION_BYTES[precision], dim_strides(layout), hw.peak_flops
    act = bytes_of["activation"]
    n_micro = work.microbatches(layout)
    tokens = work.tokens_per_microbatch(layout)  # on this rank, per micro-batch (cp splits the sequence)
    ranks = rank_stages(shapes.n_blocks, layout.pp, features.schedule)
    top_k = getattr(c, "top_k", 1)

    # one block, one micro-batch, on one rank: forward + backward
    float8, tensorwise = features.float8 is not None, features.float8 == "tensorwise"
    # whole experts under tp (expert_tp=1): each tp rank routes its own 1/tp of the tokens through whole experts
    routed_tokens = tokens / layout.tp if shapes.whole_experts else tokens
    gemm = _gemm_seconds(shapes.dense_block, tokens, layout.tp, layout.ep, top_k, kern, peak, float8)
    # dropless routing: the busiest ep rank's experts get `imbalance` times their share of the rows, and its
    # all-to-alls receive (dispatch) or send (combine) as much more; the step waits for it
    imbalance = shapes.routing_imbalance(layout.ep, layout.tp, layout.cp, work.micro_batch)
    gemm += _gemm_seconds(shapes.expert_block, routed_tokens * imbalance, layout.tp, layout.ep, top_k, kern, peak)
    heads_width = c.n_heads * c.attention_head_dim
    attention = 0.5 * 12 * tokens * work.seq_len * heads_width / layout.tp / (peak * kern.attention_peak_fraction)
    accesses = kern.elementwise_accesses_compiled if features.compile else kern.elementwise_accesses
    elementwise = tokens * (c.dim + _ffn_width(c)) / layout.tp * accesses * act / hw.memory_bandwidth
    router = router_seconds(c, routed_tokens, act, hw.memory_bandwidth) if shapes.is_moe else 0.0
    recipe = features.float8
    casts = float8_cast_seconds(shapes.block, tokens, layout.tp, recipe, kern, hw.memory_bandwidth) if recipe else 0.0
    forward_backward = gemm + attention + elementwise + router + casts
    # selective under tp also runs wo's row-parallel matmul forward again (its partial sum is not kept); the
    # recompute stops before w2's (lit_mesh.parallel.activation_checkpointing)
    wo = shapes.first_row_parallel if layout.tp > 1 else ()
    row_parallel = _gemm_seconds(wo, tokens, layout.tp, layout.ep, top_k, kern, peak, float8)
    # "full/2": the checkpointed blocks' share f of the model's, each term weighed between none's and the mode's
    mode, others, f = ac_mode(ac), ac_others(ac), checkpointed_share(shapes.n_blocks, ac)

    def by_mode(values: dict[str, float]) -> float:
        return (1 - f) * values[others] + f * values[mode]

    recompute = by_mode(
        {"none": 0.0, "selective": (elementwise + router + row_parallel) / 3, "full": forward_backward / 3}
    )
    block = forward_backward + recompute
    head = _gemm_seconds(shapes.last, tokens, layout.tp, 1, 1, kern, peak)
    # the slowest pp rank: the one with the head (its blocks and the head) or the fullest one; with v stages per
    # rank, its v stages' blocks
    blocks = max(r.total_blocks for r in ranks)
    stage = max(blocks * block, next(r.total_blocks for r in ranks if r.last) * block + head)
    t = StepTime(
        compute_parts={
            "gemm": n_micro * blocks * gemm + (n_micro * head if stage > blocks * block else 0.0),
            "attention": n_micro * blocks * attention,
            "elementwise": n_micro * blocks * elementwise,
            "recompute": n_micro * blocks * recompute,
        }
    )
    if router:
        t.compute_parts["router"] = n_micro * blocks * router
    if casts:
        t.compute_parts["float8_casts"] = n_micro * blocks * casts
    stage_numel = fullest_state_numel(shapes, layout, features.schedule)
    t.optimizer = stage_numel * kern.adamw_bytes_per_parameter / hw.memory_bandwidth

    # FSDP / HSDP: per block, gathered forward and backward each micro-batch, reduce-scattered (fp32) and
    # all-reduced over the replicas on the last one; hidden behind the previous block's compute where shorter
    dense_numel, experts, float8_numel = gathered_numels(shapes, layout)
    k, k_experts = fsdp_degree(layout), expert_fsdp_degree(shapes, layout)
    shard_link = hw.link(stride["cp"] if layout.cp > 1 else stride["dp_shard"], k)
    # float8 "tensorwise": torchao's FSDP2 extension gathers the float8 linears' weights in float8 (one byte each)
    fp8 = float8_numel if tensorwise else 0
    units = (
        (dense_numel, (dense_numel - fp8) * bytes_of["gather"] + fp8, k),
        (experts, experts * bytes_of["gather"], k_experts),
    )
    gather = reduce = 0.0
    for numel, gathered_bytes, group in units:
        if numel and group > 1:
            gather += all_gather_time(gathered_bytes, group, shard_link)
            reduce += all_gather_time(numel * 4, group, shard_link)
    if layout.dp_replicate > 1:
        reduce += all_reduce_time(
            (dense_numel / k + experts / max(k_experts, 1)) * 4,
            layout.dp_replicate,
            hw.link(stride["dp_replicate"], layout.dp_replicate),
        )
    if gather or reduce:
        forward, backward = block / 3, 2 * block / 3
        # the last block stays gathered from its forward to its backward (lit_mesh/parallel/data.py)
        per_micro = gather + max(0.0, gather - forward) * (blocks - 1) + max(0.0, gather - backward) * (blocks - 1)
        last = max(0.0, gather + reduce - backward) * blocks - max(0.0, gather - backward) * (blocks - 1)
        # passes that gather the weights again (under pp lit_mesh keeps them gathered through the schedule)
        gathers = n_micro if features.reshard_after_forward and layout.pp == 1 else 1
        t.exposed["fsdp"] = gathers * per_micro + last
        t.overlapped["fsdp"] = blocks * (2 * gathers * gather + reduce) - gathers * gather
        if features.zero_stage < 3:  # one forward gather per step; each reduction behind the backward's compute
            reductions = n_micro if features.zero_stage == 2 else 1
            t.exposed["fsdp"] = (
                gather + max(0.0, gather - forward) * (blocks - 1) + reductions * max(0.0, reduce - backward) * blocks
            )
            t.overlapped["fsdp"] = blocks * (gather + reductions * reduce)

    tp_link = hw.link(1, layout.tp)
    if layout.tp > 1:  # per block 2 all-gathers + 2 reduce-scatters forward, the same backward; full AC's recompute
        # gathers twice again and stops before the last reduce-scatter, selective's gathers twice again; without AC
        # backward gathers the two sequence-parallel inputs again (lit_mesh/parallel/regather.py: eager blocks only;
        # each waited on by the matmul right after it, so exposed) (lit_mesh/planner/traffic.py, as counted)
        regions = shapes.tp_regions  # whole experts under tp: attention alone gathers
        regathered = regions if regathers(features.schedule, layout.pp) and not features.compile else 0
        # full AC's recompute: the gathers and every reduce-scatter but a dense block's last (an MoE block's routing
        # needs the attention's)
        recomputed = 3 if regions == 2 else 2
        collectives = 4 * regions + by_mode({"none": regathered, "selective": regions, "full": recomputed})
        hidden = all_gather_time(tokens * c.dim * act, layout.tp, tp_link)
        per_block = collectives * hidden
        # the stage's ends: without pp the embedding's output is reduce-scattered and the head's input gathered
        # (forward and backward) and the loss runs on vocabulary shards; a pipeline stage gathers the logits
        ends = 4 * hidden if layout.pp == 1 else all_gather_time(tokens * c.vocab_size * act, layout.tp, tp_link)
        if features.async_tp:  # torch's micro-pipeline TP overlaps the forward's all-gather -> matmul and
            # matmul -> reduce-scatter (the recomputed forward's too) with the matmuls; the backward's 4 stay exposed
            per_block = 4 * hidden
        if shapes.expert_tp:  # the tp ranks' partial expert outputs summed forward, the tokens' gradients backward
            routed = ep_message_bytes(shapes, layout, work, act)[1]  # the tokens' copies, as routed
            per_block += (2 + by_mode({"none": 0, "selective": 0, "full": 1})) * all_reduce_time(
                routed, layout.tp, tp_link
            )
        t.exposed["tp"] = n_micro * (blocks * per_block + (ends if stage > blocks * block else 0.0))
    # pp x MoE: a forward-only routing pass over the step's micro-batches measures the load the aux loss needs
    # before the schedule runs (lit_mesh/parallel/pipeline/moe.py): one forward more, with its all-to-alls
    routing_pass = layout.pp > 1 and shapes.is_moe and features.routing_pass
    if routing_pass:
        t.compute_parts["routing_pass"] = n_micro * blocks * forward_backward / 3
    if layout.ep > 1:  # the whole sequence of the micro-batch is routed on every tp rank (whole experts: its tp
        # shard): top_k copies per token, (ep - 1) / ep of them to other ranks: the ring all-gather's bytes on the link
        dispatched, routed = ep_message_bytes(shapes, layout, work, act)
        # dispatch and combine forward and backward, in the routing pass forward; full AC's recompute runs the
        # dispatch again, not the combine (lit_mesh/parallel/expert_combine.py)
        dispatches = 2 + by_mode({"none": 0, "selective": 0, "full": 1}) + (1 if routing_pass else 0)
        combines = 2 + (1 if routing_pass else 0)
        ep_link = hw.link(ep_stride_of(shapes, layout, features.ep_stride), layout.ep)
        if shapes.ep_nodes > 1:  # by node: each token once per node over the inter-node links (one rank per node),
            # then its routed copies inside the node; the partial sums home the same two ways
            nodes, per_node = shapes.ep_nodes, layout.ep // shapes.ep_nodes
            tokens_between, table = by_node_message_bytes(shapes, layout, work, act)
            inter, intra = hw.link(hw.devices_per_node, nodes), hw.link(1, per_node)
            all_to_alls = dispatches * (
                all_gather_time(tokens_between + table, nodes, inter) + all_gather_time(dispatched, per_node, intra)
            )
            all_to_alls += combines * (
                all_gather_time(tokens_between, nodes, inter) + all_gather_time(routed, per_node, intra)
            )
        else:
            all_to_alls = dispatches * all_gather_time(dispatched, layout.ep, ep_link)
            all_to_alls += combines * all_gather_time(routed, layout.ep, ep_link)
        all_to_alls *= imbalance
        t.overlapped["ep"] = n_micro * blocks * all_to_alls
        exposed = max(0.0, all_to_alls - block) if features.ep_overlap else all_to_alls
        t.exposed["ep"] = n_micro * blocks * exposed
    if layout.cp > 1:  # ring: cp - 1 K/V blocks forward (again under full AC), backward K/V and the fp32 dK/dV
        # accumulator, each behind one step's attention; the accumulator's last trip home is exposed
        bandwidth, alpha = hw.link(stride["cp"], layout.cp)
        kv = tokens * 2 * c.n_kv_heads * c.attention_head_dim // layout.tp * act
        step_attention = attention / layout.cp
        send, accumulator = alpha + kv / bandwidth, alpha + kv * 4 / act / bandwidth
        forwards = 1 + by_mode({"none": 0, "selective": 0, "full": 1})
        exposed = (layout.cp - 1) * (
            forwards * max(0.0, send - step_attention / 3) + max(0.0, send + accumulator - 2 * step_attention / 3)
        )
        t.exposed["cp"] = n_micro * blocks * (exposed + accumulator)
        t.overlapped["cp"] = n_micro * blocks * ((forwards + 1) * (layout.cp - 1) * send + layout.cp * accumulator)
    if layout.pp > 1:  # one activation forward and one gradient backward per micro-batch and stage boundary: v
        # boundaries per rank with v stages per rank
        bandwidth, alpha = hw.link(stride["pp"], 2)
        hops = features.schedule.stages_per_rank
        t.exposed["pp"] = n_micro * 2 * hops * (alpha + tokens * c.dim * act / layout.tp / bandwidth)
        t.bubble = bubble_fraction(features.schedule, layout.pp, n_micro)
    return t
