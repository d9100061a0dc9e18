"""MeshMonitor's formulas by hand (pipeline bubble, FLOPs per token of the GPT and ViT), and collectives outside
a process group. The logged values across ranks: tests/integration/test_monitor.py."""

from __future__ import annotations

import pytest
import torch

from zoo.flops import gpt_flops_per_token, vit_flops_per_token
from zoo.gpt import GPT, GPTConfig
from zoo.vit import ViTConfig


def test_bubble_formulas_by_hand() -> None:
    from lit_mesh.monitor.pipeline_timeline import bubble_formula

    assert bubble_formula("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_formula("1f1b", 2, 2) == pytest.approx(1 / 3)
    assert bubble_formula("interleaved_1f1b", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_formula("looped_bfs", 2, 4, 2) == pytest.approx(1 / 9)
    assert bubble_formula("zero_bubble", 2, 4, 2) == pytest.approx(1 / 25)
    assert bubble_formula("zbv", 2, 4, 2) is None


def test_vit_flops_per_token_from_the_formula() -> None:
    c = ViTConfig.from_preset("tiny")
    s, d = c.seq_len, c.dim
    per_image = (
        6
        * (
            c.n_patches * c.in_channels * c.patch_size**2 * d
            + s * c.depth * (4 * d * d + 2 * d * c.mlp_hidden)
            + d * c.n_classes
        )
        + 12 * c.depth * s * s * d
    )
    assert vit_flops_per_token(c) == pytest.approx(per_image / s)


def test_gpt_flops_per_token_is_six_n_plus_attention() -> None:
    c = GPTConfig.from_preset("tiny")
    model = GPT(c)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embeddings" not in n)
    assert gpt_flops_per_token(c, 64) == 6 * matmul + 12 * c.n_layers * 64 * c.dim


def test_collectives_outside_a_process_group_are_not_needed_to_run() -> None:
    from lit_mesh.monitor import CollectiveBytes

    with CollectiveBytes() as counter:
        torch.ones(3).sum()
    assert dict(counter.sent) == {}
