"""Activation checkpointing: which blocks are checkpointed, that they recompute, that numbers do not change."""

from __future__ import annotations

import pytest
import torch

from lit_mesh.parallel.activation_checkpointing import apply_activation_checkpointing
from zoo.gpt import GPT, GPTConfig


def _forward_calls(mode: str, every_n: int) -> tuple[list[int], float, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", n_layers=4))
    apply_activation_checkpointing(model.layers, mode, every_n)
    calls = [0] * len(model.layers)
    for index, block in enumerate(model.layers):
        # a pre-hook: early-stopping recomputation may end before a late submodule returns
        block.attention.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(tokens).logsumexp(-1).mean()
    loss.backward()
    return calls, loss.item(), model.layers[0].attention.wq.weight.grad.clone()


@pytest.mark.parametrize(
    ("mode", "every_n", "expected"),
    [("none", 1, [1, 1, 1, 1]), ("full", 1, [2, 2, 2, 2]), ("full", 2, [1, 2, 1, 2]), ("selective", 1, [2, 2, 2, 2])],
)
def test_checkpointed_blocks_recompute_in_backward_with_the_same_numbers(
    mode: str, every_n: int, expected: list[int]
) -> None:
    calls, loss, grad = _forward_calls(mode, every_n)
    assert calls == expected  # a checkpointed block runs its forward again in backward
    _, ref_loss, ref_grad = _forward_calls("none", 1)
    assert loss == ref_loss
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("mode", "every_n", "message"), [("some", 1, "choose one of"), ("full", 0, "must be an int >= 1")]
)
def test_bad_activation_checkpointing_arguments(mode: str, every_n: int, message: str) -> None:
    from lit_mesh import MeshStrategy

    with pytest.raises(ValueError, match=message):
        MeshStrategy(activation_checkpointing=mode, ac_every_n_blocks=every_n)
