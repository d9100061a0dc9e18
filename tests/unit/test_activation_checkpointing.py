"""Activation checkpointing: which blocks are checkpointed, that they recompute, that numbers do not change."""

from __future__ import annotations

import pytest
import torch

from lit_mesh.parallel.activation_checkpointing import apply_activation_checkpointing
from zoo.gpt import GPT, GPTConfig


def _forward_calls(mode: str, every_n: int, other_blocks: str = "none") -> tuple[list[int], float, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", n_layers=4))
    apply_activation_checkpointing(model.layers, mode, every_n, other_blocks=other_blocks)
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


def test_other_blocks_selective_between_full_ones() -> None:
    """ac_other_blocks="selective": the blocks ac_every_n_blocks=2 leaves out run selective AC. Every block then
    recomputes in backward; the matmuls backward runs are full/2's (selective recomputes none), and the numbers are
    those without AC."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.count += func.overloadpacket.__name__ in ("mm", "addmm", "bmm")
            return func(*args, **(kwargs or {}))

    def backward_matmuls(other_blocks: str) -> int:
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_preset("tiny", n_layers=4))
        apply_activation_checkpointing(model.layers, "full", 2, other_blocks=other_blocks)
        loss = model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))).logsumexp(-1).mean()
        with CountMatmuls() as counted:
            loss.backward()
        return counted.count

    calls, loss, grad = _forward_calls("full", 2, "selective")
    assert calls == [2, 2, 2, 2]  # full/2 alone: [1, 2, 1, 2]
    assert backward_matmuls("selective") == backward_matmuls("none")
    _, ref_loss, ref_grad = _forward_calls("none", 1)
    assert loss == ref_loss
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("mode", "every_n", "other_blocks", "message"),
    [
        ("some", 1, "none", "choose one of"),
        ("full", 0, "none", "must be an int >= 1"),
        ("full", 2, "full", r"ac_other_blocks='full'; choose one of \('none', 'selective'\)"),
        ("full", 1, "selective", "ac_every_n_blocks=1 leaves none; use activation_checkpointing='full' with"),
        ("selective", 2, "selective", "activation_checkpointing='selective', ac_every_n_blocks=2 leaves none"),
    ],
)
def test_bad_activation_checkpointing_arguments(mode: str, every_n: int, other_blocks: str, message: str) -> None:
    from lit_mesh import MeshStrategy

    with pytest.raises(ValueError, match=message):
        MeshStrategy(activation_checkpointing=mode, ac_every_n_blocks=every_n, ac_other_blocks=other_blocks)


def test_a_pipeline_stage_checkpoints_the_models_every_nth_blocks() -> None:
    """Under pp, ac_every_n_blocks counts the model's blocks, not the stage's, so the same blocks are checkpointed on
    every layout: 8 blocks split 1 / 3 / 1 / 3 over 4 stages, pp rank 1 of 2 (interleaved: stages 1 and 3) holds
    blocks 1, 2, 3 and 5, 6, 7; every 2nd block of the model is 1, 3, 5, 7 (the rank's own every 2nd: 2, 5, 7)."""
    from types import SimpleNamespace

    from lit_mesh.parallel.activation_checkpointing import checkpointed, checkpointed_in
    from lit_mesh.parallel.apply import _block_indices
    from lit_mesh.parallel.pipeline.split import split_into_stages, stage_ranks

    model = GPT(GPTConfig.from_preset("tiny", n_layers=8))
    plan = model.parallel_plan()
    split = [1, 3, 1, 3]  # stages 0..3; loop placement: rank 1 runs stages 1 and 3
    split_into_stages(model, plan, split, stage_ranks(4, 2, "loop"), pp_rank=1)
    (indices,) = _block_indices([SimpleNamespace(module=model, plan=plan)], without_plan=False)
    assert indices == [1, 2, 3, 5, 6, 7]
    assert apply_activation_checkpointing(list(model.layers), "full", 2, indices) == 4
    assert [int(name) for name, block in model.layers.named_children() if checkpointed(block)] == [1, 3, 5, 7]
    assert [checkpointed_in(start, n, 2) for start, n in ((0, 1), (1, 3), (4, 1), (5, 3))] == [0, 2, 0, 2]


def test_selective_checkpointing_keeps_float8_matmuls() -> None:
    """torchao's float8 linears matmul with aten._scaled_mm on the GPU (CPU emulates it with mm, so no CPU step can
    see this): selective AC must keep its output like mm's, or it recomputes every float8 GEMM of the block."""
    from torch.utils.checkpoint import CheckpointPolicy

    from lit_mesh.parallel.activation_checkpointing import _policy, _saved_ops

    scaled_mm = torch.ops.aten._scaled_mm.default
    saved = _saved_ops()
    assert scaled_mm in saved
    a, b = torch.zeros(16, 32), torch.zeros(32, 16)
    assert _policy(saved, None, scaled_mm, a, b) == CheckpointPolicy.MUST_SAVE
