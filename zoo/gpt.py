"""A Llama-style decoder-only transformer in plain PyTorch (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Nothing here knows about meshes. The model declares in `parallel_plan()` how it may be split; the code is
written so that the same forward runs unchanged on a tensor-parallel shard:
- attention reshapes with -1 heads, so after wq/wk/wv are split column-wise it runs on the local heads;
- blocks take the activation as their only positional argument (a TP hook converts only that one);
- RoPE has no buffers (cos/sin are recomputed each forward), so meta-device construction needs no fix-up;
- the embedding, final norm and output head may be None (a pipeline stage that does not own them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lit_mesh.init import Init, init_parameters
from lit_mesh.kernels import grouped_query_attention
from lit_mesh.plan import ContextPlan, ParallelPlan, PipelinePlan, TensorPlan


@dataclass
class TransformerConfig:
    """The decoder shape the zoo GPT and the zoo MoE share (zoo.moe.MoEConfig extends it with its routing):
    attention, RoPE, norms and the dense SwiGLU feed-forward."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128  # the dense feed-forward's hidden units
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    # the width of one attention head; None: dim / n_heads. Set where n_heads x head_dim is not dim (Qwen3,
    # Mistral-Nemo): wq and wo then map dim to and from n_heads x head_dim
    head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim for heads of another width"
            )
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or self.head_dim < 2):
            raise ValueError(f"head_dim={self.head_dim!r} must be a whole number >= 2 (or None: dim / n_heads)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.attention_head_dim % 2:
            raise ValueError(f"head_dim={self.attention_head_dim} must be even for RoPE")

    @property
    def attention_head_dim(self) -> int:
        """The width of one head: head_dim where set, else dim / n_heads."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    def attention_matmul_params(self) -> int:
        """One layer's attention weights: wq and wo (dim x n_heads x head_dim each), wk and wv (dim x n_kv_heads x
        head_dim each)."""
        hd = self.attention_head_dim
        return self.dim * self.n_heads * hd * 2 + self.dim * self.n_kv_heads * hd * 2

    def feed_forward_matmul_params(self) -> int:
        """The feed-forward weights one token passes through, over all layers (SwiGLU: w1, w2, w3)."""
        return self.n_layers * 3 * self.dim * self.ffn_hidden

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), the convention of PaLM's MFU: matmuls count 2
        FLOPs per multiply-add, so 6 x (matmul weights a token passes through, the output head included: a tied
        head still runs its matmul); attention scores and weighted values add 12 x layers x seq_len x (heads x
        head_dim), counted dense (no causal halving). Norms, activations, softmax and embedding lookups are left out."""
        matmul_params = self.n_layers * self.attention_matmul_params() + self.feed_forward_matmul_params()
        matmul_params += self.dim * self.vocab_size  # the output head
        return 6.0 * matmul_params + 12.0 * self.n_layers * seq_len * self.n_heads * self.attention_head_dim


@dataclass
class GPTConfig(TransformerConfig):
    # one matmul for SwiGLU's w1 and w3 (a (2 * ffn_hidden, dim) weight, w1 rows first); tp = 1 only, and its
    # state dict still converts to transformers (the converter splits it)
    fused_w13: bool = False
    # the output head uses the token embedding's weight (one (vocab_size, dim) matrix, its gradient the sum of both
    # uses; Llama 3.2 1B/3B): converts to transformers' tie_word_embeddings=True; under pp the first and the last stage each hold a
    # copy, kept one matrix (lit_mesh/parallel/pipeline/tied.py)
    tie_embeddings: bool = False

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> GPTConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


_LLAMA3 = dict(vocab_size=128256, n_kv_heads=8, rope_theta=500000.0, max_seq_len=8192)
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=256),
    "small": GPTConfig(256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384, max_seq_len=512),
    "llama3.2-1b": GPTConfig(dim=2048, n_layers=16, n_heads=32, ffn_hidden=8192, tie_embeddings=True, **_LLAMA3),
    "llama3-8b": GPTConfig(dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336, **_LLAMA3),
    "llama3-70b": GPTConfig(dim=8192, n_layers=80, n_heads=64, ffn_hidden=28672, **_LLAMA3),
    "llama3-405b": GPTConfig(dim=16384, n_layers=126, n_heads=128, ffn_hidden=53248, **_LLAMA3),
}


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape (T, 1, head_dim / 2) (broadcast over heads), in fp32: computed once
    per forward and reused by every layer."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(positions.to(torch.float32), freqs)[:, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate (B, T, H, head_dim) by the position angles (the "rotate half" convention).

    The halves are views of x (no fp32 copy of q/k): each product promotes to fp32 inside its kernel, so the
    numbers are those of an explicit upcast; the one new tensor is the rotated output."""
    cos, sin = rope
    x1, x2 = x.unflatten(-1, (2, -1)).unbind(-2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.head_dim = config.attention_head_dim
        # the ratio of query heads to key/value heads survives a column-wise split of wq, wk and wv
        self.n_rep = config.n_heads // config.n_kv_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: the local number of heads under tensor parallelism
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        # grouped-query attention: each kv head serves n_rep consecutive query heads (K/V not repeated)
        y = grouped_query_attention(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), of `hidden` units (default: the config's ffn_hidden; the MoE's shared experts
    are one of these, n_shared_experts x expert_hidden wide)."""

    def __init__(self, config: TransformerConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = config.ffn_hidden if hidden is None else hidden
        if isinstance(config, GPTConfig) and config.fused_w13:  # one (2 * hidden, dim) matmul; w1's rows first
            self.w13 = nn.Linear(config.dim, 2 * hidden, bias=False)
        else:
            self.w1 = nn.Linear(config.dim, hidden, bias=False)
            self.w3 = nn.Linear(config.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "w13"):
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope=rope)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one Parameter in two modules; TP shards both over the vocabulary (dim 0)
            self.output.weight = self.tok_embeddings.weight
        # on the meta device the strategy initialises the (sharded) weights with the same rules
        if next(self.parameters()).device.type != "meta":
            init_parameters(self, self.parallel_plan().init)

    def forward(self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab_size), no softmax.

        A pipeline stage without the embedding receives hidden states (B, T, dim) instead. `positions`
        (T,) overrides 0..T-1, e.g. for a context-parallel shard of the sequence.
        """
        T = tokens.shape[1]
        if positions is None:
            if T > self.config.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
            positions = torch.arange(T, device=tokens.device)
        rope = rope_cos_sin(positions, self.config.attention_head_dim, self.config.rope_theta)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h, rope=rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def parallel_plan(self) -> ParallelPlan:
        c = self.config
        return ParallelPlan(
            blocks="layers",
            tp=TensorPlan(
                # the output's logits stay vocabulary-sharded into the loss (loss parallel)
                root={"tok_embeddings": "embedding", "norm": "norm", "output": "vocab_head"},
                block={
                    "attention_norm": "norm",
                    "attention": "gather_input",
                    "attention.wq": "colwise",
                    "attention.wk": "colwise",
                    "attention.wv": "colwise",
                    "attention.wo": "rowwise",
                    "ffn_norm": "norm",
                    "feed_forward": "gather_input",
                    "feed_forward.w1": "colwise",
                    "feed_forward.w3": "colwise",
                    "feed_forward.w2": "rowwise",
                },
                divides={
                    "n_heads": c.n_heads,
                    "n_kv_heads": c.n_kv_heads,
                    "ffn_hidden": c.ffn_hidden,
                    "vocab_size": c.vocab_size,
                },
                unavailable=(
                    "fused_w13=True keeps w1 and w3 in one weight, which a column-wise split would cut between them;"
                    " use fused_w13=False with tp > 1"
                    if c.fused_w13
                    else ""
                ),
            ),
            pp=PipelinePlan(first=("tok_embeddings",), last=("norm", "output")),
            # context parallel swaps the attention's scaled_dot_product_attention and passes global positions
            cp=ContextPlan(attention="attention", positions="positions"),
            # leading '*' so the rules still match under a wrapper prefix; residual outputs scaled down
            # with depth (GPT-2) so the residual stream does not grow with the number of layers
            init=(
                ("*norm.weight", Init("ones")),
                ("*.wo.weight", Init("normal", 0.02 / math.sqrt(2 * c.n_layers))),
                ("*.w2.weight", Init("normal", 0.02 / math.sqrt(2 * c.n_layers))),
                ("*", Init("normal", 0.02)),
            ),
        )

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters, a tied embedding/head matrix counted once. exclude_embedding leaves out the lookup table,
        unless it is tied: then it is also the head, a matmul."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None and not self.config.tie_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: GPTConfig.flops_per_token (the one formula, zoo.flops)."""
        return self.config.flops_per_token(seq_len)
