"""The tolerance for sums taken in another order (tests/workers/checks.py reduction_atol): it passes what only the
summation order changes and still catches a real error of one element."""

from __future__ import annotations

import pytest
import torch

from tests.workers.checks import assert_close_reduced, reduction_atol

K = 384  # the reduced dimension


def operands() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(16, K, generator=gen), torch.randn(K, 24, generator=gen)


def test_equal_tensors_pass() -> None:
    a, b = operands()
    reference = a @ b
    assert_close_reduced(reference.clone(), reference, K)


def test_sums_in_another_order_pass() -> None:
    """The same products summed in 8 blocks (as 8 ranks would) and in float64: only rounding differs."""
    a, b = operands()
    reference = (a.double() @ b.double()).float()
    blocked = sum(a[:, i : i + K // 8] @ b[i : i + K // 8] for i in range(0, K, K // 8))
    assert not torch.equal(blocked, reference)  # the order does change the last bits
    assert_close_reduced(blocked, reference, K)


@pytest.mark.parametrize("where", ["largest", "smallest"])
def test_one_element_off_by_1e_4_fails(where: str) -> None:
    """One element off by 1e-4 relative to the values' scale (the largest element's own value, or a near-zero
    element moved by 1e-4 of the largest) fails; such an error is 5x the tolerance at this K."""
    a, b = operands()
    reference = a @ b
    flat = reference.abs().flatten()
    index = int(flat.argmax() if where == "largest" else flat.argmin())
    wrong = reference.clone().flatten()
    wrong[index] += 1e-4 * flat.max()
    assert 1e-4 * flat.max().item() > 5 * reduction_atol(reference, K)
    with pytest.raises(AssertionError, match="weight gradient"):
        assert_close_reduced(wrong.view_as(reference), reference, K, msg="weight gradient")
