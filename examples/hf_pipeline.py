"""A transformers causal LM trained with pipeline parallelism, the training step unchanged: `model(..., labels=...).loss`.

    python examples/hf_pipeline.py --devices 2 --pp 2                     # Llama, 2 stages, 1F1B
    python examples/hf_pipeline.py --devices 2 --pp 2 --schedule gpipe    # GPipe
    python examples/hf_pipeline.py --arch gpt2 --devices 2 --pp 2         # GPT-2: tied embeddings on both ends
    python examples/hf_pipeline.py --devices 4 --pp 2 --tp 2              # 2 stages x tensor + sequence parallel
    python examples/hf_pipeline.py --arch gpt2 --devices 4 --pp 2 --tp 2  # the same for GPT-2
    python examples/hf_pipeline.py --devices 4 --pp 2 --cp 2              # 2 stages x context parallel over 2
    python examples/hf_pipeline.py --devices 2 --pp 2 --layers 4 --schedule interleaved_1f1b --stages-per-rank 2

The step is what one writes on one device: `self.model(input_ids=x, labels=x).loss`. Under pp MeshStrategy runs the
pipeline schedule over the micro-batches inside that call (forward and backward), and the loss transformers would
compute comes back on every rank. Under context parallel (Llama) each rank holds a part of every sequence: its stages
get the tokens' global positions, and transformers' label shift runs over the whole sequence. Validation calls the
model the same way (forward only). The model is built whole in `__init__`, so every layout starts from the same
weights and the losses match a single-device run.
"""

from __future__ import annotations

import _common as E  # noqa: N812 (examples/ is on sys.path when run as a script)
import lightning as L
import torch
from hf_model import GLOBAL_BATCH, make_config, make_data
from torch.utils.data import DataLoader

from lit_mesh import MeshStrategy


class PipelinedLM(L.LightningModule):
    def __init__(self, arch: str = "llama", layers: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        config = make_config(arch)
        config.num_hidden_layers = layers  # GPT-2's n_layer by its alias
        self.model = AutoModelForCausalLM.from_config(config)
        self.lr = lr
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, _ = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels itself
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        tokens, _ = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.val_losses.append(self.trainer.strategy.reduce(loss, reduce_op="mean").item())

    def train_dataloader(self) -> DataLoader:
        return E.global_batch_slice(self, *make_data(GLOBAL_BATCH * 64), GLOBAL_BATCH)

    def val_dataloader(self) -> DataLoader:
        return E.global_batch_slice(self, *make_data(GLOBAL_BATCH * 2, seed=99), GLOBAL_BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> list[float]:
    parser = E.parser(__doc__)
    parser.add_argument("--arch", default="llama", choices=["llama", "gpt2"])
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (one per rank)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (2 stages per rank need >= 4)")
    parser.add_argument("--schedule", default="1f1b", help="pp_schedule: 1f1b, gpipe, interleaved_1f1b, ...")
    parser.add_argument("--stages-per-rank", type=int, default=1, help="pp_stages_per_rank (interleaved, V: 2)")
    parser.add_argument("--microbatches", type=int, default=2, help="pp_microbatches (dualpipev: >= 2 x pp)")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree (Llama): the sequence split")
    parser.add_argument("--no-sp", action="store_true", help="tp without sequence parallelism")
    args = E.parse(parser, argv)

    L.seed_everything(0, verbose=False)
    module = PipelinedLM(args.arch, args.layers)
    dp = args.devices // (args.tp * args.pp * args.cp)
    pipeline = {}
    if args.pp > 1:
        pipeline = dict(
            pp=args.pp,
            pp_schedule=args.schedule,
            pp_microbatches=args.microbatches,
            pp_stages_per_rank=args.stages_per_rank,
        )
    strategy = MeshStrategy(dp=dp, tp=args.tp, cp=args.cp, sequence_parallel=False if args.no_sp else None, **pipeline)
    trainer = E.trainer(args, strategy)
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    return E.report(trainer, module.losses, args.out, val_losses=module.val_losses)


if __name__ == "__main__":
    main()
