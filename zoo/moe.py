"""A sparse mixture-of-experts decoder (Mixtral / DeepSeek-MoE / Qwen-MoE style) in plain PyTorch.

The zoo GPT's attention, RMSNorm and RoPE (imported, not copied), with feed-forward layers that are MoE
layers (all, or every k-th): a token-choice top-k router (softmax or sigmoid scores), optional shared experts,
and SwiGLU experts stored as stacked weights (n_experts, ...) so that all experts are one parameter each.

Routing, in `Router` and `MoE.forward`:
- selection: the top-k experts by score (+ the balancing bias, for selection only); ties go to the lower
  expert index (a stable sort), so routing is deterministic;
- dropless by default; with `capacity_factor` each expert takes at most ceil(cf * seq_len * top_k / n_experts)
  assignments per sequence, first choices before second choices, earlier tokens first; the rest are dropped
  (the token keeps its residual and the shared experts). Counting per sequence keeps dropping independent of
  how sequences are spread over ranks;
- balancing: the Switch auxiliary loss coef * E * sum_i f_i * P_i, with f_i the fraction of assignments to
  expert i over the GLOBAL batch (the dispatcher sums the counts over data-parallel ranks) and P_i the mean
  router probability of this rank's tokens: averaging the per-rank losses over ranks then gives exactly the
  single-device loss and gradients. Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the
  scores for selection only, nudged after each optimizer step by rate * sign(mean load - load).

Nothing here knows about meshes: tokens reach the experts through `MoE.dispatcher` (`LocalDispatch` here),
which expert parallel swaps for an all-to-all (lit_mesh/parallel/expert.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lit_mesh.init import Init, init_parameters
from lit_mesh.plan import ContextPlan, MoEPlan, ParallelPlan, PipelinePlan, TensorPlan, TPStyle
from zoo.gpt import Attention, FeedForward, TransformerConfig, rope_cos_sin


@dataclass(kw_only=True)
class MoEConfig(TransformerConfig):
    """The zoo GPT's shape (TransformerConfig: vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_hidden for the
    dense feed-forward layers when moe_every > 1, norm_eps, rope_theta, max_seq_len) and the routing of its MoE
    layers (keyword-only)."""

    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 64
    n_shared_experts: int = 0  # each of width expert_hidden, seen by every token
    moe_every: int = 1  # layers k-1, 2k-1, ... are MoE; 1: all
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = True  # gate weights of the chosen experts sum to 1 (top_k > 1; top-1 keeps its probability)
    capacity_factor: float | None = None  # None: dropless
    aux_loss_coef: float = 0.01  # 0: no auxiliary loss
    bias_update_rate: float = 0.0  # aux-loss-free balancing step (DeepSeek-V3 uses 0.001); 0: off
    # group-limited routing (DeepSeek-V3's node-limited routing: n_group 8, topk_group 4): the experts in n_groups
    # equal groups, each token's top_k chosen among its topk_groups best groups; 1 and 1: off
    n_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()  # dim / heads / RoPE checks of the zoo GPT
        if self.n_experts < 1:
            raise ValueError(f"n_experts={self.n_experts} must be >= 1")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} must be between 1 and n_experts={self.n_experts}; choose top_k <= {self.n_experts}"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} must be > 0 (e.g. 1.25), or None for dropless routing"
            )
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={self.score_func!r}: choose 'softmax' or 'sigmoid'")
        if self.moe_every < 1:
            raise ValueError(f"moe_every={self.moe_every} must be >= 1 (1: every layer is MoE)")
        if self.n_layers < self.moe_every:
            raise ValueError(f"moe_every={self.moe_every} > n_layers={self.n_layers} leaves no MoE layer")
        if self.n_groups < 1 or self.n_experts % self.n_groups:
            raise ValueError(f"n_groups={self.n_groups} must be >= 1 and divide n_experts={self.n_experts}")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"topk_groups={self.topk_groups} must be between 1 and n_groups={self.n_groups}")
        if self.top_k > self.topk_groups * self.n_experts // self.n_groups:
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.topk_groups * self.n_experts // self.n_groups} experts of"
                f" topk_groups={self.topk_groups} groups of {self.n_experts // self.n_groups}; raise topk_groups"
            )
        if self.aux_loss_coef < 0 or self.bias_update_rate < 0:
            raise ValueError(
                f"aux_loss_coef={self.aux_loss_coef} and bias_update_rate={self.bias_update_rate} must be >= 0"
            )

    def feed_forward_matmul_params(self) -> int:
        """Only the experts a token uses (top_k routed + shared) and the router in MoE layers; the dense
        feed-forward in the others (TransformerConfig.flops_per_token counts the rest)."""
        n_moe = sum(self.is_moe_layer(i) for i in range(self.n_layers))
        moe = 3 * self.dim * self.expert_hidden * (self.top_k + self.n_shared_experts) + self.dim * self.n_experts
        return n_moe * moe + (self.n_layers - n_moe) * 3 * self.dim * self.ffn_hidden

    def is_moe_layer(self, index: int) -> bool:
        return (index + 1) % self.moe_every == 0

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> MoEConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown MoE preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, expert_hidden=64),
    "small": MoEConfig(
        256,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=384,
        n_experts=8,
        top_k=2,
        expert_hidden=128,
        n_shared_experts=1,
        max_seq_len=512,
    ),
    # Mixtral-8x7B's shapes: 8 experts, top-2 softmax, 14336-wide SwiGLU experts, every layer MoE
    "mixtral-8x7b": MoEConfig(
        32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        n_experts=8,
        top_k=2,
        expert_hidden=14336,
        rope_theta=1e6,
        max_seq_len=32768,
    ),
    # Mixtral-8x22B's shapes (Mistral's config.json): 56 layers of dim 6144, 48 heads (8 K/V), 8 experts of 16384, top-2
    "mixtral-8x22b": MoEConfig(
        32768,
        dim=6144,
        n_layers=56,
        n_heads=48,
        n_kv_heads=8,
        ffn_hidden=16384,
        n_experts=8,
        top_k=2,
        expert_hidden=16384,
        rope_theta=1e6,
        max_seq_len=65536,
    ),
    # DeepSeek-V3 671B-A37B (technical report, arXiv 2412.19437): 61 layers of dim 7168, 256 routed experts of 2048 and
    # 1 shared, top-8 sigmoid scores among the best 4 of 8 expert groups (node-limited routing), aux-loss-free
    # balancing. Planned as every layer MoE (the report's first 3 dense layers of 18432: the same 3 x 7168 x 18432
    # weights per token as 9 experts of 2048). MLA as multi-head attention of 56 heads x 128 (q, k, v, o: 4 x 7168^2
    # weights per token, within 10% of MLA's low-rank projections; the attention core's FLOPs fewer than MLA's 128
    # heads x (192 + 128)); no multi-token-prediction module.
    "deepseek-v3": MoEConfig(
        129280,
        dim=7168,
        n_layers=61,
        n_heads=56,
        n_kv_heads=56,
        ffn_hidden=18432,
        n_experts=256,
        top_k=8,
        expert_hidden=2048,
        n_shared_experts=1,
        score_func="sigmoid",
        aux_loss_coef=0.0,
        bias_update_rate=0.001,
        max_seq_len=4096,
        n_groups=8,  # node-limited routing (report 2.1.2, config.json's n_group / topk_group): at most 4 nodes
        topk_groups=4,
    ),
    # Qwen3-235B-A22B (Qwen's config.json): 94 layers of dim 4096, 64 heads of 128 (4 K/V: wq is 8192 x 4096), 128
    # experts of 1536, top-8 softmax renormalised, every layer MoE. Its QK-norm (an RMSNorm of 128 per head on q
    # and k) is left out: shapes for `lit-mesh plan` (Megatron-Core's MoE tables, lit_mesh/planner/calibration.yaml)
    "qwen3-235b-a22b": MoEConfig(
        151936,
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        ffn_hidden=12288,
        n_experts=128,
        top_k=8,
        expert_hidden=1536,
        norm_eps=1e-6,
        rope_theta=1e6,
        max_seq_len=40960,
        aux_loss_coef=0.001,
    ),
    # DeepSeek-V3-style routing at a small size: sigmoid scores, 1 shared + 16 fine-grained experts, top-4
    "deepseek-small": MoEConfig(
        256,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        n_experts=16,
        top_k=4,
        expert_hidden=64,
        n_shared_experts=1,
        score_func="sigmoid",
        aux_loss_coef=0.0,
        bias_update_rate=0.001,
        max_seq_len=512,
    ),
}


class ExpertBias(nn.Module):
    """The aux-loss-free balancing bias: added to the scores for expert selection only (not a parameter)."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.register_buffer("bias", torch.zeros(n_experts))

    def reset_parameters(self) -> None:  # called on meta-device materialisation
        self.bias.zero_()


@dataclass
class Routing:
    """What the router decides for N tokens: top-k expert ids and gate weights (N, k), and the router
    probabilities over all experts (N, E) that the auxiliary loss uses."""

    expert_ids: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor


def limit_to_groups(selection: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """selection (N, E) with the experts outside each token's topk_groups best groups at -inf. A group's score is the
    sum of its two best selection scores (DeepSeek-V3's; its best one where a group holds one expert); equal scores
    go to the lower group."""
    n, n_experts = selection.shape
    per_group = n_experts // n_groups
    group_scores = selection.view(n, n_groups, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
    kept = torch.zeros(n, n_groups, dtype=torch.bool, device=selection.device).scatter_(1, best, True)
    return selection.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))


class Router(nn.Module):
    """Token-choice top-k routing in fp32."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.score_func = config.score_func
        self.normalize_top_k = config.normalize_top_k
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)
        self.expert_bias = ExpertBias(config.n_experts)
        self.n_groups, self.topk_groups = config.n_groups, config.topk_groups

    def forward(self, tokens: torch.Tensor) -> Routing:
        logits = self.gate(tokens).float()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        selection = scores.detach() + self.expert_bias.bias
        if self.n_groups > 1:
            selection = limit_to_groups(selection, self.n_groups, self.topk_groups)
        # a stable descending sort: equal scores keep index order, so ties go to the lower expert id
        expert_ids = torch.sort(selection, dim=-1, descending=True, stable=True).indices[:, : self.top_k]
        weights = scores.gather(1, expert_ids)
        if self.normalize_top_k and self.top_k > 1:  # a top-1 weight of 1 would leave the router no LM gradient
            weights = weights / weights.sum(dim=-1, keepdim=True)
        probs = scores if self.score_func == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return Routing(expert_ids, weights, probs)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # expert parallel keeps the stacked weights as DTensors sharded by expert; compute on this rank's slice
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


class GroupedExperts(nn.Module):
    """n_experts SwiGLU feed-forwards as stacked weights: w2(silu(x w1) * x w3) per expert."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """tokens (M, dim) grouped by expert, tokens_per_expert[e] rows each (an int tensor on tokens' device) ->
        (M, dim)."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        if tokens_per_expert.shape[0] != w1.shape[0]:
            raise ValueError(f"{tokens_per_expert.shape[0]} token groups for {w1.shape[0]} experts")
        if tokens.dtype != w1.dtype and tokens.dtype.is_floating_point:
            # mixed precision without FSDP (e.g. expert parallel alone): fp32 weights meet bf16 tokens; compute in
            # the tokens' dtype, as FSDP's param_dtype would (the gradient flows back to the fp32 weights)
            w1, w2, w3 = w1.to(tokens.dtype), w2.to(tokens.dtype), w3.to(tokens.dtype)
        # one grouped GEMM per weight instead of a Python loop over the experts (no tokens: the loop gives the
        # weights their zero gradients); the offsets stay on the device: no host read
        if tokens.shape[0] and grouped_mm_runs(tokens.contiguous(), w1, w2, w3):
            tokens = tokens.contiguous()
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            hidden = F.silu(F.grouped_mm(tokens, w1, offs=offsets)) * F.grouped_mm(tokens, w3, offs=offsets)
            out = F.grouped_mm(hidden, w2, offs=offsets)
            if out.requires_grad:  # grouped_mm's backward needs a contiguous gradient (a hook: an identity
                # autograd.Function would return a view, which FSDP2 warns about for a module's output)
                out.register_hook(torch.Tensor.contiguous)
            return out
        # the loop's split sizes are host integers: a host read, except without tokens (every group is empty)
        sizes = tokens_per_expert.tolist() if tokens.shape[0] else [0] * w1.shape[0]
        outputs = [(F.silu(x @ a) * (x @ c)) @ b for x, a, b, c in zip(tokens.split(sizes), w1, w2, w3)]
        return torch.cat(outputs)


def grouped_mm_runs(tokens: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Where F.grouped_mm has a kernel for these operands (torch 2.13): the CPU (with backward), and CUDA in bf16 on
    Hopper or newer; rows of a multiple of 16 bytes (the kernels' layout rule). Elsewhere (and under autocast, where
    tokens and weights differ in dtype) the loop."""
    if tokens.device.type == "cuda":
        if tokens.dtype != torch.bfloat16 or torch.cuda.get_device_capability(tokens.device) < (9, 0):
            return False
    elif tokens.device.type != "cpu":
        return False
    return all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in (tokens, *weights)
    )


class LocalDispatch:
    """All experts on this device: the global load is the local one, tokens go straight to the experts."""

    def global_load(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return tokens_per_expert

    def mean_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """The mean router probabilities (N, E) -> (E,) of the tokens the aux loss weighs on this rank."""
        return probs.mean(dim=0)

    def combine(
        self,
        experts: GroupedExperts,
        tokens: torch.Tensor,
        token_index: torch.Tensor,
        weights: torch.Tensor,
        tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        """Each token's weighted sum of its experts' outputs: assignment i takes tokens[token_index[i]] to its expert
        (grouped by expert, tokens_per_expert of each) with weight weights[i]."""
        out = experts(tokens[token_index], tokens_per_expert)
        return torch.zeros_like(tokens).index_add(0, token_index, out * weights[:, None].to(out.dtype))


def expert_counts(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, (n_experts,) int64. torch.bincount would read the max id on the host (a sync on CUDA)."""
    return torch.zeros(n_experts, dtype=torch.long, device=expert_ids.device).index_add_(
        0, expert_ids, torch.ones_like(expert_ids)
    )


def capacity_mask(expert_ids: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which assignments (B, T, k) fit: per sequence and expert the first `capacity`, in the order
    (choice rank, position): every token's first choice before any second choice, earlier tokens first."""
    B, T, k = expert_ids.shape
    order = expert_ids.transpose(1, 2).reshape(B, k * T)  # choice-major
    one_hot = F.one_hot(order, n_experts)
    slot = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1  # position of each assignment in its expert's queue
    return (slot < capacity).view(B, k, T).transpose(1, 2)


class MoE(nn.Module):
    """Routed experts (+ shared experts) replacing the dense feed-forward of a block."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.capacity_factor = config.capacity_factor
        self.aux_loss_coef = config.aux_loss_coef
        self.bias_update_rate = config.bias_update_rate
        self.router = Router(config)
        self.experts = GroupedExperts(config.n_experts, config.dim, config.expert_hidden)
        self.shared_experts: FeedForward | None = None
        if config.n_shared_experts:
            self.shared_experts = FeedForward(config, hidden=config.n_shared_experts * config.expert_hidden)
        self.dispatcher = LocalDispatch()  # expert parallel swaps in an all-to-all (the plan's `moe.layer`)
        # statistics of the last forward (detached), read by the LightningModule for logging and balancing
        self.load = torch.zeros(config.n_experts)
        self.dropped = torch.zeros(())
        self.aux_loss: torch.Tensor = torch.zeros(())
        # this rank's, of the last forward: tokens per expert, and the mean router probabilities (differentiable)
        self.local_load, self.mean_probs = self.load, torch.zeros(config.n_experts)

    def capacity(self, seq_len: int) -> int:
        assert self.capacity_factor is not None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        # the shared experts first: the routed experts' combine is the layer's last step, so a checkpoint's recompute
        # can stop before it (an expert-parallel combine does not run its all-to-all again)
        shared = self.shared_experts(tokens) if self.shared_experts is not None else None
        routing = self.router(tokens)
        self.local_load, self.mean_probs = (
            expert_counts(routing.expert_ids.flatten(), self.n_experts),
            self.dispatcher.mean_probs(routing.probs),
        )
        if not getattr(self.dispatcher, "reduces_load_later", False):  # the local load is the global one
            self.use_load(self.local_load)

        token_index = torch.arange(B * T, device=x.device).repeat_interleave(self.top_k)
        expert_ids, weights = routing.expert_ids.flatten(), routing.weights.flatten()
        if self.capacity_factor is not None:
            keep = capacity_mask(routing.expert_ids.view(B, T, self.top_k), self.n_experts, self.capacity(T)).flatten()
            self.dropped = (~keep).sum().detach()
            token_index, expert_ids, weights = token_index[keep], expert_ids[keep], weights[keep]
        order = torch.argsort(expert_ids, stable=True)  # group the assignments by expert
        token_index, weights = token_index[order], weights[order]
        tokens_per_expert = expert_counts(expert_ids, self.n_experts)
        out = self.dispatcher.combine(self.experts, tokens, token_index, weights, tokens_per_expert)
        if shared is not None:
            out = out + shared
        return out.view(B, T, D)

    def use_load(self, load: torch.Tensor) -> None:
        """Set the global tokens per expert of the last forward, and the aux loss that depends on it."""
        self.load = load.detach()
        self.aux_loss = self.aux_loss_of(load, self.mean_probs)

    def aux_loss_of(self, load: torch.Tensor, mean_probs: torch.Tensor) -> torch.Tensor:
        """The Switch balancing loss for the global tokens per expert `load` and this rank's mean router
        probabilities: linear in `mean_probs` (pipeline stages add it per micro-batch: lit_mesh/parallel/pipeline/moe.py)."""
        return self.aux_loss_coef * self.n_experts * ((load / load.sum()) * mean_probs).sum()

    @torch.no_grad()
    def update_expert_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing: raise the bias of underloaded experts, lower it for overloaded ones."""
        if self.bias_update_rate > 0:
            bias = self.router.expert_bias.bias
            bias += self.bias_update_rate * torch.sign(load.float().mean() - load.float()).to(bias.device, bias.dtype)


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig, moe: bool) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        # one of the two: blocks are MoE or dense (then exactly the zoo GPT's feed-forward)
        self.moe: MoE | None = MoE(config) if moe else None
        self.feed_forward: FeedForward | None = None if moe else FeedForward(config)

    def forward(self, x: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope=rope)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return x + ffn(self.ffn_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(MoEBlock(config, config.is_moe_layer(i)) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if next(self.parameters()).device.type != "meta":
            init_parameters(self, self.parallel_plan().init)

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size); each MoE layer keeps its aux loss and load.

        A pipeline stage without the embedding receives hidden states (B, T, dim) instead. `positions` (T,) overrides 0..T-1, e.g. for a context-parallel shard of the sequence.
        """
        T = tokens.shape[1]
        if positions is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
            positions = torch.arange(T, device=tokens.device)
        rope = rope_cos_sin(positions, self.config.attention_head_dim, self.config.rope_theta)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # a later pipeline stage
        for layer in self.layers:
            h = layer(h, rope=rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers if layer.moe is not None]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' auxiliary losses of the last forward (differentiable).

        A dispatcher that `reduces_load_later` (expert parallel, data parallel) leaves each layer's load local in
        forward: it is summed over ranks here, for every layer in one collective, and sets each layer's `load`.
        """
        layers = self.moe_layers()
        dispatcher = layers[0].dispatcher
        if getattr(dispatcher, "reduces_load_later", False):
            loads = dispatcher.global_load(torch.stack([moe.local_load for moe in layers]))
            for moe, load in zip(layers, loads):
                moe.use_load(load)
        return torch.stack([moe.aux_loss for moe in layers]).sum()

    def parallel_plan(self) -> ParallelPlan:
        c = self.config
        # expert_hidden: expert tensor parallel splits each expert's hidden units over tp
        divides = {
            "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads,
            "vocab_size": c.vocab_size,
            "expert_hidden": c.expert_hidden,
        }
        block: dict[str, TPStyle] = {
            "attention_norm": "norm",
            "attention": "gather_input",
            "attention.wq": "colwise",
            "attention.wk": "colwise",
            "attention.wv": "colwise",
            "attention.wo": "rowwise",
            "ffn_norm": "norm",
            # MoE blocks route the whole sequence, replicated over tp: routing and capacity then see the
            # same tokens on every layout (the experts' hidden units are split over tp: MoEPlan.hidden_dims);
            # expert_tp=1 routes each tp rank's sequence shard instead (MoEPlan.token_wise: what runs per token)
            "moe": "whole_sequence",
        }
        if any(layer.feed_forward is not None for layer in self.layers):  # dense blocks: the zoo GPT's plan
            divides["ffn_hidden"] = c.ffn_hidden
            block.update(
                {
                    "feed_forward": "gather_input",
                    "feed_forward.w1": "colwise",
                    "feed_forward.w3": "colwise",
                    "feed_forward.w2": "rowwise",
                }
            )
        residual_std = 0.02 / math.sqrt(2 * c.n_layers)
        return ParallelPlan(
            blocks="layers",
            tp=TensorPlan(
                root={"tok_embeddings": "embedding", "norm": "norm", "output": "vocab_head"},
                block=block,
                divides=divides,
            ),
            moe=MoEPlan(
                layer="moe",
                ep_divides={"n_experts": c.n_experts},
                hidden_dims={"w1": 2, "w3": 2, "w2": 1},
                token_wise=("router.gate",) + (("shared_experts",) if c.n_shared_experts else ()),
            ),
            pp=PipelinePlan(first=("tok_embeddings",), last=("norm", "output")),
            # context parallel swaps the attention's scaled_dot_product_attention and passes global positions
            cp=ContextPlan(attention="attention", positions="positions"),
            init=(
                ("*norm.weight", Init("ones")),
                ("*.wo.weight", Init("normal", residual_std)),
                ("*.w2.weight", Init("normal", residual_std)),
                ("*.experts.w2", Init("normal", residual_std)),
                ("*", Init("normal", 0.02)),
            ),
        )

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        return n


def moe_flops_per_token(config: MoEConfig, seq_len: int) -> float:
    """Training FLOPs per token counting only the experts a token uses (top_k routed + shared) and the router
    (MoEConfig.flops_per_token)."""
    return config.flops_per_token(seq_len)
