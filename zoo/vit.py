"""A Vision Transformer classifier in plain PyTorch, with DINOv2-style register tokens.

Nothing here knows about meshes; `parallel_plan()` says how it may be split. Choices made for tensor
parallelism: q, k and v are separate Linears (a column-wise split of each keeps whole heads on a rank),
attention reshapes with -1 heads, and register tokens let the token count be made divisible by the tp
degree for sequence parallelism. The patch projection is a Linear on flattened patches rather than a
Conv2d: the same maths (weights in Conv2d's (C, p, p) order), but a plain Linear every technique handles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lit_mesh.init import Init, init_parameters
from lit_mesh.plan import ParallelPlan, PipelinePlan, TensorPlan


@dataclass
class ViTConfig:
    image_size: int = 8
    patch_size: int = 2
    in_channels: int = 1
    n_classes: int = 10
    dim: int = 64
    depth: int = 2
    n_heads: int = 4
    mlp_hidden: int = 128
    n_registers: int = 3
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size={self.image_size} is not divisible by patch_size={self.patch_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image: patches + class token + registers."""
        return self.n_patches + 1 + self.n_registers

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, the convention of TransformerConfig.flops_per_token (6 x matmul weights, 12 x
        depth x seq_len x dim for the attention), averaged over an image's tokens: the patch embedding runs on the
        patch tokens only, the head once per image. `seq_len` is ignored (an image is always `self.seq_len` tokens):
        the argument keeps the language models' signature."""
        s, d = self.seq_len, self.dim
        patch_embedding = self.n_patches * self.in_channels * self.patch_size**2 * d  # patch tokens only
        blocks = s * self.depth * (4 * d * d + 2 * d * self.mlp_hidden)
        head = d * self.n_classes  # once per image
        per_image = 6.0 * (patch_embedding + blocks + head) + 12.0 * self.depth * s * s * d
        return per_image / s

    @classmethod
    def from_preset(cls, name: str, **overrides: object) -> ViTConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown ViT preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, ViTConfig] = {
    # 8x8 grey digits: 16 patches + 1 class + 3 registers = 20 tokens (divisible by tp 1, 2, 4)
    "tiny": ViTConfig(8, 2, 1, 10, dim=64, depth=2, n_heads=4, mlp_hidden=128, n_registers=3),
    "small": ViTConfig(8, 2, 1, 10, dim=128, depth=4, n_heads=4, mlp_hidden=256, n_registers=3),
    "vit-b16": ViTConfig(224, 16, 3, 1000, dim=768, depth=12, n_heads=12, mlp_hidden=3072, n_registers=0),
}


class PatchEmbedding(nn.Module):
    """(B, C, H, W) images -> (B, seq_len, dim) tokens: [class, registers..., patches] + position embedding."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.proj = nn.Linear(config.in_channels * config.patch_size**2, config.dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, config.dim))
        self.registers = nn.Parameter(torch.empty(1, config.n_registers, config.dim))
        self.pos_embed = nn.Parameter(torch.empty(1, config.seq_len, config.dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        B, C, H, W = images.shape
        p = self.patch_size
        # non-overlapping patches, each flattened in (C, p, p) order, row-major over the patch grid
        patches = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        x = self.proj(patches)
        x = torch.cat([self.cls_token.expand(B, -1, -1), self.registers.expand(B, -1, -1), x], dim=1)
        return x + self.pos_embed


class Attention(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        self.q = nn.Linear(config.dim, config.dim)
        self.k = nn.Linear(config.dim, config.dim)
        self.v = nn.Linear(config.dim, config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        # -1 heads: the local number of heads under tensor parallelism
        q, k, v = (lin(x).view(B, S, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)  # every token sees every token
        return self.proj(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.mlp_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(config.mlp_hidden, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed: PatchEmbedding | None = PatchEmbedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.head: nn.Linear | None = nn.Linear(config.dim, config.n_classes)
        # on the meta device the strategy initialises the (sharded) weights with the same rules
        if next(self.parameters()).device.type != "meta":
            init_parameters(self, self.parallel_plan().init)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) -> logits (B, n_classes), read from the class token.

        A pipeline stage without `embed` receives tokens (B, seq_len, dim); one without `head` returns tokens.
        """
        x = self.embed(images) if self.embed is not None else images
        for block in self.blocks:
            x = block(x)
        x = self.norm(x) if self.norm is not None else x
        return self.head(x[:, 0]) if self.head is not None else x

    def parallel_plan(self) -> ParallelPlan:
        c = self.config
        trunc = Init("trunc_normal", 0.02)
        return ParallelPlan(
            blocks="blocks",
            tp=TensorPlan(
                root={"embed": "shard_output", "norm": "gather_input"},
                block={
                    "norm1": "norm",
                    "attn": "gather_input",
                    "attn.q": "colwise",
                    "attn.k": "colwise",
                    "attn.v": "colwise",
                    "attn.proj": "rowwise",
                    "norm2": "norm",
                    "mlp": "gather_input",
                    "mlp.fc1": "colwise",
                    "mlp.fc2": "rowwise",
                },
                divides={
                    "n_heads": c.n_heads,
                    "mlp_hidden": c.mlp_hidden,
                    "tokens (patches + class + registers)": c.seq_len,
                },
            ),
            pp=PipelinePlan(first=("embed",), last=("norm", "head")),
            # leading '*' so the rules still match under a wrapper prefix
            init=(
                ("*.bias", Init("zeros")),
                ("*norm*.weight", Init("ones")),
                ("*cls_token", trunc),
                ("*registers", trunc),
                ("*pos_embed", trunc),
                ("*", trunc),
            ),
        )

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
