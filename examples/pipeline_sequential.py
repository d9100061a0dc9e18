"""Pipeline parallel for a plain nn.Sequential: four convolution stages on images, cut across ranks without a plan.

    python examples/pipeline_sequential.py --devices 4 --pp 4                    # one stage per rank, 1F1B
    python examples/pipeline_sequential.py --devices 4 --pp 4 --schedule gpipe
    python examples/pipeline_sequential.py --devices 4 --pp 2 --schedule interleaved_1f1b  # 2 stages per rank, x 2
                                                                                            # data-parallel replicas
    python examples/pipeline_sequential.py --devices 4 --pp 4 --split 6,3,3,2   # children per stage, by hand
    python examples/pipeline_sequential.py --devices 1 --out single.json

The network is the textbook one: an `nn.Sequential` of convolutions, activations and pooling, then a linear
classifier, with no `parallel_plan()`. Under `MeshStrategy(pp=N)` its children are the blocks: the pipeline stages
take them in order, balanced by parameter count (a stage begins at a child with parameters; the activation and
pooling after a convolution stay with it), or as `pp_split` says. Here the cut is one convolution stage per rank,
the classifier with the last.

The one line that changes for the pipeline is the loss: `lit_mesh.loss_of(self.model, F.cross_entropy, images,
labels)` instead of `F.cross_entropy(self.model(images), labels)`. Under pp it runs the schedule over the
micro-batches (forward and backward) and returns the batch's loss on every rank; without pp it is that plain call.

The per-step losses equal a single-device run's (up to float rounding): the weights are made in `__init__` after
`seed_everything`, and each data-parallel rank reads its slice of the same global batches (examples/_common.py).
Every schedule trains this way: "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", and the zero-bubble ones that
split the backward ("zero_bubble", "zbv", "dualpipev"); "2bw" too, with each batch's gradient applied one step late.
Rank 0 writes the per-step losses to `--out`.
"""

from __future__ import annotations

import _common as E  # noqa: N812 (examples/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lit_mesh import MeshStrategy, loss_of

GLOBAL_BATCH = 8
IMAGE_SIZE = 16  # halved by each of the four stages' pooling: 16 -> 1
N_CLASSES = 10


def conv_net(channels: int = 16) -> nn.Sequential:
    """Four convolution stages (convolution, activation, pooling), then the classifier: 14 children in all."""
    layers: list[nn.Module] = []
    for c_in in (3, channels, channels, channels):
        layers += [nn.Conv2d(c_in, channels, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels, N_CLASSES))


def make_data(n_samples: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images whose class depends on the colours of their four quadrants. Same on every rank."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n_samples, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    teacher = torch.randn(3 * 4, N_CLASSES, generator=g)
    quadrants = F.avg_pool2d(images, IMAGE_SIZE // 2).flatten(1)  # (N, 3 x 2 x 2)
    return images, (quadrants @ teacher).argmax(dim=-1)


class ImageClassifier(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.model = conv_net()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = loss_of(self.model, F.cross_entropy, images, labels)  # the pipeline's loss, on every pp rank
        # the global batch's loss: mean over the data-parallel ranks (pp ranks hold the same value)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return E.global_batch_slice(self, *make_data(GLOBAL_BATCH * 64), GLOBAL_BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)  # this rank's stages' parameters


def main(argv: list[str] | None = None) -> list[float]:
    parser = E.parser(__doc__, tp=False)
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages' ranks; dp = devices / pp")
    parser.add_argument("--schedule", default="1f1b", help="the pipeline schedule (pp > 1)")
    parser.add_argument("--split", default=None, help="children per stage, comma-separated (default: balanced)")
    args = E.parse(parser, argv)
    if args.devices % args.pp:
        parser.error(f"--pp {args.pp} must divide --devices {args.devices}")

    L.seed_everything(0, verbose=False)
    model = ImageClassifier()
    pipeline = {} if args.pp == 1 else {"pp_schedule": args.schedule}
    if args.split:
        pipeline["pp_split"] = [int(n) for n in args.split.split(",")]
    strategy = MeshStrategy(pp=args.pp, dp=args.devices // args.pp, **pipeline)
    trainer = E.trainer(args, strategy)
    trainer.fit(model)
    return E.report(trainer, model.losses, args.out, layout=strategy.layout.describe())


if __name__ == "__main__":
    main()
