"""Token data: how fast `lit-mesh prepare-data` tokenises, and how fast zoo.TokenDataModule serves batches
against what one training step of a 1B model consumes; the loader's process memory while it reads.

    python benchmarks/token_loader.py                      # the standard library's sources, seq 2048, batch 8

Corpus: every .py file of the standard library (zoo.text_data.stdlib_sources), tokenised by a byte-level BPE
of 8192 tokens trained on a few of them (tokenizers), `--workers` processes. Loader: the training loader of
one process (dp rank 0 of 1, num_workers=0), an epoch's batches of seq_len x global batch, timed end to end.

What a step of the 1B model consumes: a Llama-3.2-1B-shaped GPT (dim 2048, 16 layers, 32 heads, 8 kv heads,
ffn 8192, vocab 128256) does 6 x N + 12 x L x d x T FLOPs per token (zoo.flops); its step time on this CPU is
DERIVED from this CPU's measured fp32 matmul rate (a 2048^3 matmul, all threads) at 100% of that rate, a
generous bound (the full step does not fit the shared machine's memory). A GPU figure is STATED, not measured:
H100 bf16 dense 989 TFLOP/s at 40% MFU, per GPU (each dp rank loads its own slice).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.flops import gpt_flops_per_token  # noqa: E402
from zoo.gpt import PRESETS  # noqa: E402

H100_BF16_FLOPS, STATED_MFU = 989e12, 0.40


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process (heap, tensors): not the page cache of memory-mapped files."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """The highest RssAnon seen, sampled every millisecond in a thread."""

    def __init__(self) -> None:
        self.peak = rss_anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())


def train_bpe(files: list[Path], vocab: int, path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train([str(f) for f in files], trainer)
    tokenizer.save(str(path))
    return path


def matmul_flops(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def one_b_config():  # noqa: ANN201
    import dataclasses

    return dataclasses.replace(PRESETS["llama3-8b"], dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192)


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained for the corpus")
    p.add_argument("--workers", type=int, default=2, help="prepare-data processes")
    p.add_argument("--max-batches", type=int, default=200, help="loader batches timed (at most one epoch)")
    p.add_argument("--max-files", type=int, default=0, help="tokenise only the first N source files (0: all)")
    p.add_argument("--matmul-size", type=int, default=2048, help="side of the matmul that measures this CPU's rate")
    args = p.parse_args(argv)

    from zoo.prepare_data import prepare
    from zoo.text_data import stdlib_sources
    from zoo.token_data import TokenDataModule

    files = stdlib_sources()[: args.max_files or None]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_bpe(files[:: max(1, len(files) // 40)], args.vocab, Path(tmp) / "tokenizer.json")
        start = time.perf_counter()
        meta = prepare(
            [str(f) for f in files],
            str(tokenizer),
            f"{tmp}/shards",
            val_fraction=0.01,
            workers=args.workers,
            progress=False,
        )
        prepare_s = time.perf_counter() - start
        corpus_tokens = sum(meta["splits"]["train"]["tokens"]) + sum(meta["splits"]["val"]["tokens"])
        shard_bytes = sum(f.stat().st_size for f in Path(tmp, "shards").glob("*.bin"))

        data = TokenDataModule(path=f"{tmp}/shards", seq_len=args.seq_len, global_batch_size=args.global_batch_size)
        data.setup()
        loader = data.train_dataloader()
        before = rss_anon_bytes()
        tokens = batches = 0
        with PeakSampler() as sampler:
            start = time.perf_counter()
            for x, _y in loader:
                tokens += x.numel()
                batches += 1
                if batches == args.max_batches:
                    break
            load_s = time.perf_counter() - start
    loader_tokens_per_s = tokens / load_s

    config = one_b_config()
    flops_per_token = gpt_flops_per_token(config, args.seq_len)
    step_tokens = args.seq_len * args.global_batch_size
    cpu_flops = matmul_flops(args.matmul_size)
    cpu_step_s = step_tokens * flops_per_token / cpu_flops
    gpu_tokens_per_s = STATED_MFU * H100_BF16_FLOPS / flops_per_token
    return {
        "config": {
            "seq_len": args.seq_len,
            "global_batch_size": args.global_batch_size,
            "vocab": args.vocab,
            "prepare_workers": args.workers,
            "files": len(files),
            "num_workers": 0,
        },
        "prepare": {
            "tokens": corpus_tokens,
            "seconds": round(prepare_s, 2),
            "tokens_per_s": round(corpus_tokens / prepare_s),
            "shard_bytes": shard_bytes,
            "dtype": meta["dtype"],
        },
        "loader": {
            "batches": batches,
            "tokens": tokens,
            "seconds": round(load_s, 4),
            "tokens_per_s": round(loader_tokens_per_s),
            "rss_anon_before_mib": round(before / 2**20, 1),
            "rss_anon_peak_growth_mib": round((sampler.peak - before) / 2**20, 2),
        },
        "one_b": {
            "params": sum(p.numel() for p in _meta_gpt(config).parameters()),
            "flops_per_token": flops_per_token,
            "step_tokens": step_tokens,
            "cpu_matmul_flops": round(cpu_flops),
            "cpu_step_s_derived": round(cpu_step_s, 1),
            "cpu_consumes_tokens_per_s": round(step_tokens / cpu_step_s, 1),
            "h100_consumes_tokens_per_s_stated": round(gpu_tokens_per_s),
        },
        "loader_over_cpu_step": round(loader_tokens_per_s / (step_tokens / cpu_step_s)),
        "loader_over_h100_step": round(loader_tokens_per_s / gpu_tokens_per_s, 1),
        "goal_20x_met_cpu": loader_tokens_per_s >= 20 * step_tokens / cpu_step_s,
    }


def _meta_gpt(config):  # noqa: ANN001, ANN202
    from zoo.gpt import GPT

    with torch.device("meta"):
        return GPT(config)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
