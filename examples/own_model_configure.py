"""Your own parallelism: a LightningModule that parallelises itself in `configure_model`.

    python examples/own_model_configure.py --devices 2 --tp 2     # tensor parallel over 2 ranks
    python examples/own_model_configure.py --devices 2            # FSDP over 2 ranks
    python examples/own_model_configure.py --devices 4 --tp 2     # FSDP over 2 x tensor parallel over 2
    python examples/own_model_configure.py --devices 1 --out single.json

The escape hatch for full control. `MeshStrategy(dp=..., tp=...)` builds the N-D DeviceMesh; the module
reads it as `self.device_mesh` (dims "pp", "dp_replicate", "dp_shard", "cp", "tp") and applies torch's
parallelism itself: `parallelize_module` on `self.device_mesh["tp"]` (column-wise then row-wise Linears,
Megatron style) and `fully_shard` (FSDP2) over `self.device_mesh["dp_shard"]`. Because the model already holds
DTensor / FSDP parameters after `configure_model`, the strategy applies no plan and leaves it as it is.
(Flattened views such as dp_replicate x dp_shard are on `self.trainer.strategy.mesh_views`.)

The model (an MLP regressor on synthetic data made here with a fixed seed) is created in `__init__`, after
`seed_everything`, so every rank starts from the same full weights; `parallelize_module` and `fully_shard`
then keep each rank's part. Every data-parallel rank takes its own slice of the same global batch, so the
per-step losses match a single-device run. Rank 0 writes them to `--out` as JSON.
"""

from __future__ import annotations

import _common as E  # noqa: N812 (examples/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from lit_mesh import MeshStrategy

GLOBAL_BATCH = 16
N_FEATURES, HIDDEN, WIDTH, N_TARGETS = 16, 64, 32, 4


def make_data(n_samples: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression: targets from a fixed random two-layer teacher plus noise. Same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, N_FEATURES, generator=g)
    w1, w2 = torch.randn(N_FEATURES, WIDTH, generator=g), torch.randn(WIDTH, N_TARGETS, generator=g)
    y = torch.tanh(x @ w1 / N_FEATURES**0.5) @ w2 + 0.1 * torch.randn(n_samples, N_TARGETS, generator=g)
    return x, y


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        # two column-wise/row-wise pairs: every parameter is split or replicated over tp, none left plain
        self.mlp = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN),  # 0: colwise
            nn.GELU(),
            nn.Linear(HIDDEN, WIDTH),  # 2: rowwise (output summed over tp)
            nn.GELU(),
            nn.Linear(WIDTH, HIDDEN),  # 4: colwise
            nn.GELU(),
            nn.Linear(HIDDEN, N_TARGETS),  # 6: rowwise
        )
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if getattr(self, "_parallelised", False):  # configure_model may be called again (e.g. fit then test)
            return
        tp_mesh, dp_mesh = self.device_mesh["tp"], self.device_mesh["dp_shard"]
        if tp_mesh.size() > 1:
            if HIDDEN % tp_mesh.size():
                raise ValueError(f"tp={tp_mesh.size()} must divide the hidden width {HIDDEN}")
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
            parallelize_module(self.mlp, tp_mesh, plan)
        if dp_mesh.size() > 1:
            for index in ("0", "2", "4", "6"):  # one FSDP unit per Linear, then the rest
                fully_shard(self.mlp.get_submodule(index), mesh=dp_mesh)
            fully_shard(self.mlp, mesh=dp_mesh)  # never the LightningModule itself
        self._parallelised = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        # loss of the global batch: mean over the data-parallel ranks (tp ranks hold copies)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return E.global_batch_slice(self, *make_data(GLOBAL_BATCH * 64), GLOBAL_BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> list[float]:
    args = E.parse(E.parser(__doc__), argv)

    L.seed_everything(0, verbose=False)
    model = Regressor()
    strategy = MeshStrategy(dp=args.devices // args.tp, tp=args.tp)
    trainer = E.trainer(args, strategy)
    trainer.fit(model)
    return E.report(trainer, model.losses, args.out, layout=strategy.layout.describe())


if __name__ == "__main__":
    main()
