"""Step time of a layout: a compute roofline plus an alpha-beta model of every collective.

Ring collectives over a group of k ranks: lit_mesh.topology's all_gather_time (also reduce-scatter) and
all_reduce_time (twice that), the formula the hierarchical all-reduce uses too. A group's bandwidth and alpha are the intra-node ones when its ranks share a node, else the inter-node ones
(the ring is as slow as its slowest link). Overlap rule: FSDP/HSDP/DDP gradient and parameter traffic and the
context-parallel ring hide behind compute (prefetch, ring overlap): max(compute, overlapped); tensor-parallel
collectives sit on the critical path and add; pipeline send/receive adds; the 1F1B bubble stretches the whole
step by (pp - 1) / micro-batches. MoE: the expert weights' FSDP traffic runs over expert_dp (dp_shard x cp / ep)
ranks, and every MoE block sends its routed tokens to their experts and back with all-to-alls over ep
(dispatch + combine in forward, both again in backward, and in the recomputed forward under full AC), exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lit_mesh.mesh import MeshLayout
from lit_mesh.parallel.pipeline_split import balanced_split
from lit_mesh.planner.hardware import Hardware
from lit_mesh.planner.memory import PRECISION_BYTES, Workload, fsdp_degree, unsharded_numel
from lit_mesh.planner.shapes import ModelShapes
from lit_mesh.topology import all_gather_time, all_reduce_time
from zoo.flops import gpt_flops_per_token

# extra matmul work of each activation-checkpointing mode: full recomputes every block's forward (1 of the
# 3 forward+backward units); selective recomputes only norms and elementwise ops, which the roofline ignores
RECOMPUTE = {"none": 0.0, "selective": 0.0, "full": 1.0 / 3.0}


@dataclass
class StepTime:
    compute: float
    overlapped: dict[str, float] = field(default_factory=dict)  # hidden behind compute while it lasts
    exposed: dict[str, float] = field(default_factory=dict)  # on the critical path
    bubble: float = 0.0  # fraction the pipeline bubble adds

    @property
    def total(self) -> float:
        return (max(self.compute, sum(self.overlapped.values())) + sum(self.exposed.values())) * (1 + self.bubble)


def flops_per_token(shapes: ModelShapes, seq_len: int) -> float:
    if shapes.is_moe:  # the experts a token uses (top_k routed + shared) and the router
        from zoo.moe import moe_flops_per_token

        return moe_flops_per_token(shapes.config, seq_len)
    return gpt_flops_per_token(shapes.config, seq_len)


def model_flops_per_step(shapes: ModelShapes, work: Workload) -> float:
    return flops_per_token(shapes, work.seq_len) * work.global_batch * work.seq_len


def dim_strides(layout: MeshLayout) -> dict[str, int]:
    """Distance between neighbouring ranks of each dim's groups (tp innermost, on consecutive ranks)."""
    return {"tp": 1, "cp": layout.tp, "ep": layout.tp, "dp_shard": layout.tp * layout.cp,
            "dp_replicate": layout.tp * layout.cp * layout.dp_shard, "pp": layout.world_size // layout.pp}


def step_time(shapes: ModelShapes, layout: MeshLayout, work: Workload, precision: str, ac: str, hw: Hardware) -> StepTime:
    c = shapes.config
    bytes_of = PRECISION_BYTES[precision]
    stride = dim_strides(layout)
    # the largest stage sets the pace; its blocks' share of the matmul FLOPs (embedding/head: one block each)
    blocks = max(balanced_split(shapes.n_blocks, layout.pp))
    flops = model_flops_per_step(shapes, work) * (1 + RECOMPUTE[ac])
    compute = flops / layout.world_size * (blocks * layout.pp / shapes.n_blocks) / (hw.peak_flops * hw.compute_efficiency)
    t = StepTime(compute=compute)

    # data parallel traffic of the stage's tp-local parameters (first stage: it also holds the embedding)
    stage_numel = blocks * sum(unsharded_numel(p, layout) for p in shapes.block if not p.expert)
    stage_numel += sum(unsharded_numel(p, layout) for p in (*shapes.first, *shapes.last)) / layout.pp
    expert_numel = blocks * sum(unsharded_numel(p, layout) for p in shapes.block if p.expert)
    k = fsdp_degree(layout)
    shard_link = hw.link(stride["cp"] if layout.cp > 1 else stride["dp_shard"], k)
    microbatches = work.microbatches(layout)
    if k > 1:  # parameters gathered in forward and backward of every micro-batch (resharded after forward);
        # gradients reduce-scattered in fp32 once per step (no sync while accumulating)
        t.overlapped["fsdp"] = 2 * microbatches * all_gather_time(stage_numel * bytes_of["gather"], k, shard_link) + all_gather_time(
            stage_numel * 4, k, shard_link)
    k_experts = k // layout.ep
    if expert_numel and k_experts > 1:  # the experts' own FSDP units, over expert_dp
        t.overlapped["fsdp_experts"] = 2 * microbatches * all_gather_time(
            expert_numel * bytes_of["gather"], k_experts, shard_link) + all_gather_time(expert_numel * 4, k_experts, shard_link)
    if layout.dp_replicate > 1:  # the (sharded) gradients all-reduced over the replicas
        t.overlapped["dp_replicate"] = all_reduce_time(
            (stage_numel / k + expert_numel / max(k_experts, 1)) * 4, layout.dp_replicate,
            hw.link(stride["dp_replicate"], layout.dp_replicate))

    tokens = work.tokens_per_microbatch(layout)
    act = bytes_of["activation"]
    if layout.tp > 1:
        # per block: 2 all-gathers + 2 reduce-scatters of the (tokens, dim) activation in forward, the same in
        # backward, and the forward's again when full AC recomputes; plus the head's logits all-gather
        per_block = (8 + (4 if ac == "full" else 0)) * all_gather_time(tokens * c.dim * act, layout.tp, hw.link(1, layout.tp))
        logits = all_gather_time(tokens * c.vocab_size * act, layout.tp, hw.link(1, layout.tp)) / layout.pp
        t.exposed["tp"] = microbatches * (blocks * per_block + logits)
    if layout.ep > 1:  # the whole sequence of the micro-batch is routed on every tp rank: top_k copies per token
        routed = work.micro_batch * work.seq_len // layout.cp * c.top_k * c.dim * act
        per_block = (4 + (2 if ac == "full" else 0)) * all_gather_time(routed, layout.ep, hw.link(stride["ep"], layout.ep))
        t.exposed["ep"] = microbatches * blocks * per_block
    if layout.cp > 1:  # ring: cp - 1 K/V blocks pass in forward; K/V and their gradients in backward
        kv = tokens * 2 * c.n_kv_heads * c.head_dim // layout.tp * act
        per_block = 3 * (layout.cp - 1) * kv / hw.link(stride["cp"], layout.cp)[0] + 3 * (layout.cp - 1) * hw.link(
            stride["cp"], layout.cp)[1]
        t.overlapped["cp"] = microbatches * blocks * per_block
    if layout.pp > 1:  # one activation forward and one gradient backward per micro-batch and stage boundary
        bandwidth, alpha = hw.link(stride["pp"], 2)
        t.exposed["pp"] = microbatches * 2 * (alpha + tokens * c.dim * act / layout.tp / bandwidth)
        t.bubble = (layout.pp - 1) / microbatches
    return t
