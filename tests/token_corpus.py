"""Offline fixtures for tokenised data and pretrained models: a small byte-level BPE trained on a few files of
the Python standard library, token shards written by prepare-data, and a tiny Llama saved by save_pretrained."""

from __future__ import annotations

import os
from pathlib import Path

import torch

STDLIB = Path(os.path.dirname(os.__file__))
CORPUS_FILES = [STDLIB / name for name in ("os.py", "glob.py", "shutil.py", "textwrap.py", "fnmatch.py")]
EOS = "<|endoftext|>"
VOCAB = 384


def train_tokenizer(directory: Path) -> Path:
    """A transformers tokenizer directory (fast BPE, EOS set) trained on CORPUS_FILES; returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train([str(f) for f in CORPUS_FILES], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(directory)
    return directory


def prepare_shards(tokenizer: Path, out: Path, val_fraction: float = 0.1) -> Path:
    from zoo.prepare_data import prepare

    prepare([str(f) for f in CORPUS_FILES], str(tokenizer), str(out), val_fraction=val_fraction, progress=False)
    return out


def save_tiny_llama(directory: Path, vocab_size: int = VOCAB, seed: int = 0) -> Path:
    """A tiny random Llama written by save_pretrained in several safetensors files (with an index)."""
    from transformers import LlamaForCausalLM

    from zoo.hf.configs import tiny_config

    torch.manual_seed(seed)
    config = tiny_config("llama", vocab_size=vocab_size, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="100KB")
    return directory
