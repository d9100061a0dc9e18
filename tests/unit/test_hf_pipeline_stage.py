"""A transformers pipeline stage (lit_mesh/hf/pipeline.py) under context parallel: the global positions it is given
reach the model's rotary embeddings. Its runs across ranks: tests/integration/test_hf.py (pp2 x cp2)."""

from __future__ import annotations

import pytest
import torch

from lit_mesh.hf.pipeline import TransformersStage

transformers = pytest.importorskip("transformers")


def test_a_stage_passes_the_global_positions_it_is_given() -> None:
    """A load-balanced cp shard (chunks 0 and 3 of a 16-token sequence: positions 0..3 and 12..15, as the ring holds
    them) reaches the rotary embeddings with those positions, on the first stage (token ids) and a later one (hidden
    states); without them a stage counts 0..7."""
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config).eval()
    seen: list[torch.Tensor] = []
    model.model.rotary_emb.register_forward_pre_hook(
        lambda _module, args, kwargs: seen.append(kwargs.get("position_ids", args[-1])), with_kwargs=True
    )
    positions = torch.cat([torch.arange(0, 4), torch.arange(12, 16)])[None]
    stage = TransformersStage(model)
    with torch.no_grad():
        stage(torch.randint(0, 32, (2, 8)), position_ids=positions)
        stage(torch.randn(2, 8, 16), position_ids=positions)
        stage(torch.randn(2, 8, 16))
    assert [p.tolist() for p in seen] == [positions.tolist(), positions.tolist(), [list(range(8))]]
