"""Your own model with a parallel plan: data x tensor (x sequence) parallelism from one declaration.

    python examples/own_model_plan.py --devices 2 --tp 2           # tensor + sequence parallel over 2 ranks
    python examples/own_model_plan.py --devices 4 --tp 2           # FSDP over 2 x TP over 2
    python examples/own_model_plan.py --devices 1 --out single.json

A small transformer that tags every token of a synthetic sequence with one of 8 classes. The model knows
nothing about meshes; `parallel_plan()` declares how it may be split, and `MeshStrategy(dp=..., tp=...)`
applies that in `setup`:
- `blocks`: the ModuleList of repeated blocks, each one an FSDP unit;
- `tp`, a `TensorPlan`: TP styles by module name, outside the blocks (`root`) and inside each (`block`):
  q/k/v and fc1 "colwise", proj and fc2 "rowwise"; the norms run on the sequence shard ("norm"); attention
  and MLP gather the sequence first ("gather_input": their first positional input); the input projection's
  output enters the sequence-sharded region ("shard_output"); the classifier is the "head" (split over
  classes, gathered to full logits); `divides`: sizes the tp degree must divide (heads, MLP width, classes,
  and the sequence length for SP);
- `init`: how every parameter starts (`lit_mesh.Init`), so the sharded model created on the meta device in
  `configure_model` starts exactly like the single-device one.
The data: every data-parallel rank takes its own slice of the same global batch (ranks of one tensor-parallel
group read the same slice), so the per-step losses match a single-device run. Rank 0 writes them to `--out`.
"""

from __future__ import annotations

from dataclasses import dataclass

import _common as E  # noqa: N812 (examples/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lit_mesh import Init, MeshStrategy, ParallelPlan, TensorPlan

GLOBAL_BATCH = 8


@dataclass
class TaggerConfig:
    n_features: int = 16
    seq_len: int = 8
    dim: int = 32
    n_heads: int = 4
    mlp_hidden: int = 64
    depth: int = 2
    n_classes: int = 8


class Attention(nn.Module):
    def __init__(self, c: TaggerConfig) -> None:
        super().__init__()
        self.head_dim = c.dim // c.n_heads
        self.q, self.k, self.v = (nn.Linear(c.dim, c.dim) for _ in range(3))
        self.proj = nn.Linear(c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: after a column-wise split of q, k, v each rank runs its own heads
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: TaggerConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.dim, c.mlp_hidden)
        self.fc2 = nn.Linear(c.mlp_hidden, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, c: TaggerConfig) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(c.dim), Attention(c)
        self.norm2, self.mlp = nn.LayerNorm(c.dim), MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the activation is the only positional input
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Tagger(nn.Module):
    """features (B, T, n_features) -> logits (B, T, n_classes)."""

    def __init__(self, c: TaggerConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Linear(c.n_features, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def parallel_plan(self) -> ParallelPlan:
        c = self.config
        return ParallelPlan(
            blocks="blocks",
            tp=TensorPlan(
                root={"embed": "shard_output", "norm": "norm", "head": "head"},
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
                    "n_classes": c.n_classes,
                    "seq_len": c.seq_len,
                },
            ),
            # first match wins; leading '*' so the rules match under the LightningModule's prefix too
            init=(
                ("*.bias", Init("zeros")),
                ("*norm*.weight", Init("ones")),
                ("*", Init("trunc_normal", 0.1)),
            ),
        )


def make_data(n_samples: int, c: TaggerConfig, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic tagging: each token's class depends on the token and on the sequence mean. Same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, c.seq_len, c.n_features, generator=g)
    teacher = torch.randn(c.n_features, c.n_classes, generator=g)
    return x, ((x + x.mean(dim=1, keepdim=True)) @ teacher).argmax(dim=-1)


class TaggerModule(L.LightningModule):
    def __init__(self, config: TaggerConfig | None = None, lr: float = 3e-3) -> None:
        super().__init__()
        self.config = config or TaggerConfig()
        self.lr = lr
        self.model: Tagger | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        # on the meta device: the strategy applies the plan, then initialises each rank's shards by plan.init
        if self.model is None:
            self.model = Tagger(self.config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)  # full logits on every tp rank (the "head" gathers them)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        # loss of the global batch: mean over the data-parallel ranks (tp ranks hold copies)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return E.global_batch_slice(self, *make_data(GLOBAL_BATCH * 64, self.config), GLOBAL_BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> list[float]:
    parser = E.parser(__doc__)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    args = E.parse(parser, argv)

    L.seed_everything(0, verbose=False)
    model = TaggerModule()
    strategy = MeshStrategy(dp=args.devices // args.tp, tp=args.tp, sequence_parallel=not args.no_sequence_parallel)
    trainer = E.trainer(args, strategy)
    trainer.fit(model)
    return E.report(trainer, model.losses, args.out, layout=strategy.layout.describe())


if __name__ == "__main__":
    main()
