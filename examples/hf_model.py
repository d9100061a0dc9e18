"""A Hugging Face transformers model in your own LightningModule, trained with MeshStrategy.

    python examples/hf_model.py --devices 2 --tp 2                 # tensor + sequence parallel over 2 ranks
    python examples/hf_model.py --devices 4 --tp 2                 # FSDP over 2 x TP over 2
    python examples/hf_model.py --arch gpt2 --devices 2            # GPT-2, FSDP over 2
    python examples/hf_model.py --arch mixtral --devices 2 --ep 2  # Mixtral, FSDP over 2, experts split over 2
    python examples/hf_model.py --devices 2 --tp 2 --export-dir out   # then: LlamaForCausalLM.from_pretrained("out/hf")

Plain Lightning code around `LlamaForCausalLM` (or `GPT2LMHeadModel`, `MixtralForCausalLM`) built from a config,
no download. Nothing here names a mesh or a plan: MeshStrategy recognises the transformers model and applies its
plan (transformers' own tensor-parallel plan for Llama, ours for GPT-2, attention TP and expert parallel for
Mixtral; FSDP per decoder layer). The model is created in
`configure_model`, so each rank materialises only its shards, initialised as transformers would. Built in
`__init__` instead (e.g. with `from_pretrained`), it is sharded from the whole weights.

The task: continue arithmetic sequences of tokens (start, start + step, ...). Every data-parallel rank takes its
slice of the same global batch, so the per-step losses match a single-device run. With `--export-dir` the
trained, sharded checkpoint is written as a transformers directory (config.json + model.safetensors).
"""

from __future__ import annotations

from pathlib import Path

import _common as E  # noqa: N812 (examples/ is on sys.path when run as a script)
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lit_mesh import MeshStrategy

GLOBAL_BATCH = 8
SEQ_LEN = 32
VOCAB = 128


def make_config(arch: str):  # noqa: ANN201 - a transformers config
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    if arch == "llama":
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ_LEN,
        )
    if arch == "gpt2":  # dropout off: the losses are compared step by step across layouts
        return GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=SEQ_LEN,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    if arch == "mixtral":  # 4 experts, top-2
        return MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=SEQ_LEN,
        )
    raise ValueError(f"--arch {arch!r}: choose llama, gpt2 or mixtral")


def make_data(n_samples: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic token sequences (mod VOCAB) and their next tokens. The same on every rank."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n_samples, 1), generator=g)
    step = torch.randint(1, 8, (n_samples, 1), generator=g)
    sequence = (start + step * torch.arange(SEQ_LEN + 1)) % VOCAB
    return sequence[:, :-1], sequence[:, 1:]


class CausalLM(L.LightningModule):
    def __init__(self, arch: str = "llama", lr: float = 3e-3) -> None:
        super().__init__()
        self.config = make_config(arch)
        self.lr = lr
        self.model = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:  # under MeshStrategy: on the meta device, sharded and initialised in setup
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_config(self.config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(input_ids=tokens).logits  # whole logits on every tensor-parallel rank
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        # loss of the global batch: mean over the data-parallel ranks (tp ranks hold copies)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def train_dataloader(self) -> DataLoader:
        return E.global_batch_slice(self, *make_data(GLOBAL_BATCH * 64), GLOBAL_BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> list[float]:
    parser = E.parser(__doc__)
    parser.add_argument("--arch", default="llama", choices=["llama", "gpt2", "mixtral"])
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (Mixtral), borrowed from dp")
    parser.add_argument("--export-dir", default=None, help="write the trained model here as a transformers directory")
    args = E.parse(parser, argv)

    L.seed_everything(0, verbose=False)
    module = CausalLM(args.arch)
    trainer = E.trainer(args, MeshStrategy(dp=args.devices // args.tp, tp=args.tp, ep=args.ep))
    trainer.fit(module)
    if args.export_dir:
        checkpoint = Path(args.export_dir) / "trained.ckpt"
        trainer.save_checkpoint(checkpoint)  # sharded: one file per rank
        if trainer.is_global_zero:
            from zoo.convert import export_hf

            print("wrote", export_hf(checkpoint, Path(args.export_dir) / "hf", config=module.config))
        trainer.strategy.barrier()
    return E.report(trainer, module.losses, args.out)


if __name__ == "__main__":
    main()
