"""Per-rank memory while pretrained weights load straight into the mesh (zoo.hf.HFCausalLM(pretrained=DIR)).

    python benchmarks/pretrained_load.py                 # 4 ranks: fsdp2 x tp2, a ~90M-parameter Llama
    python benchmarks/pretrained_load.py --tp 1          # 4 ranks: fsdp4
    python benchmarks/pretrained_load.py --module zoo    # the same directory into zoo.GPTModule(pretrained=DIR)

The launcher saves a random Llama with save_pretrained (sharded safetensors, 50 MB files), then each rank runs
the real path: MeshStrategy shards the meta-device model, materialises its shards and reads its slices
(lit_mesh.pretrained). A thread samples the rank's anonymous resident memory (RssAnon: heap and tensors, not the
page cache of the memory-mapped safetensors files) every millisecond from the Trainer's setup hook (the model
still on meta) until validation starts (loaded). Goal per rank: peak growth <= 1.3 x its final shard + the
largest single tensor. For contrast: the bytes of the whole model, which from_pretrained on every rank holds.
The ranks run with MALLOC_MMAP_THRESHOLD_=65536: glibc otherwise raises its mmap threshold after the first large
free and keeps later freed blocks in its heap, so RssAnon would measure the allocator's retention, not the code.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor

import _common as C  # noqa: N812 (benchmarks/ is on sys.path when run as a script)
from token_loader import PeakSampler, rss_anon_bytes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--module", choices=["hf", "zoo"], default="hf", help="zoo.hf.HFCausalLM or zoo.GPTModule")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--directory", default=None, help="(set by the launcher) the saved model")
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def llama_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64 // 3,
                       max_position_embeddings=2048, tie_word_embeddings=False)  # fmt: skip


class LoadMemory(L.Callback):
    """RssAnon from the setup hook (model on meta) to the start of validation (model sharded and loaded), with
    the peak split at the call of lit_mesh.pretrained.load_pretrained: materialisation (allocation of the shards,
    initialisation of what no pretrained source fills) before it, reading the slices from it on. The parameters'
    sizes are taken there too: every parameter is then a shard (FSDP2 keeps the root and last block gathered
    after a forward, so they would be whole at validation)."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        import lit_mesh.strategy as strategy_module

        self.before = rss_anon_bytes()
        self.sampler = PeakSampler().__enter__()
        read = strategy_module.load_pretrained

        def measured_read(root: torch.nn.Module, sources: Any) -> None:  # the strategy's one call, measured
            self.at_read = rss_anon_bytes()
            self.materialise_peak, self.sampler.peak = self.sampler.peak, self.at_read
            params = list(root.parameters())
            self.shard = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
            self.largest = max(p.numel() * p.element_size() for p in params)
            self.whole = sum(p.numel() * p.element_size() for p in params)
            self.count = sum(p.numel() for p in params)
            read(root, sources)

        strategy_module.load_pretrained = measured_read

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sampler.__exit__()
        self.after = rss_anon_bytes()


def worker(args: argparse.Namespace) -> None:
    from lit_mesh import MeshStrategy
    from zoo import GPTModule
    from zoo.hf.modules import HFCausalLM

    memory = LoadMemory()
    kwargs = {**C.trainer_kwargs(args.ranks, 1, [memory]), "limit_val_batches": 1}
    trainer = L.Trainer(**kwargs, strategy=MeshStrategy(tp=args.tp))
    model = (GPTModule if args.module == "zoo" else HFCausalLM)(pretrained=args.directory)
    tokens = torch.randint(0, args.vocab, (args.ranks * 2, 17))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    trainer.validate(model, loader, verbose=False)
    shard, largest, whole = memory.shard, memory.largest, memory.whole
    bound = 1.3 * shard + largest
    reading, materialising = memory.sampler.peak - memory.before, memory.materialise_peak - memory.before
    per_rank = C.gather({"shard_mib": shard / 2**20, "bound_mib": bound / 2**20,
                         "reading_peak_growth_mib": reading / 2**20, "materialise_peak_growth_mib": materialising / 2**20,
                         "shards_allocated_mib": (memory.at_read - memory.before) / 2**20,
                         "after_growth_mib": (memory.after - memory.before) / 2**20,
                         "reading_within_bound": reading <= bound, "setup_within_bound": max(reading, materialising) <= bound})  # fmt: skip
    C.emit({
        "config": {"module": type(model).__name__, "ranks": args.ranks, "tp": args.tp, "dp_shard": args.ranks // args.tp, "hidden": args.hidden,
                   "layers": args.layers, "vocab": args.vocab, "params": memory.count},
        "whole_model_mib": round(whole / 2**20, 1), "largest_tensor_mib": round(largest / 2**20, 1),
        "per_rank": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in per_rank],
        "max_reading_peak_growth_mib": round(max(r["reading_peak_growth_mib"] for r in per_rank), 1),
        "max_materialise_peak_growth_mib": round(max(r["materialise_peak_growth_mib"] for r in per_rank), 1),
        "goal_met_reading": all(r["reading_within_bound"] for r in per_rank),
        "goal_met_whole_setup": all(r["setup_within_bound"] for r in per_rank),
    })  # fmt: skip


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if C.in_worker():
        worker(args)
        return
    import os

    from transformers import LlamaForCausalLM

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the ranks (see the docstring)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(args)).save_pretrained(tmp, max_shard_size="50MB")
        result = C.launch(__file__, [*argv, "--directory", tmp], args.ranks, args.timeout)
    C.print_result(result)


if __name__ == "__main__":
    main(sys.argv[1:])
