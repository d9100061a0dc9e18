"""tests/workers/checks.py `assert_close_reduction`: it passes a sum computed in another order (the rounding that
made a fixed atol of 1e-6 fail at random in tests/workers/tp_grid.py) and still fails a wrong result."""

from __future__ import annotations

import pytest
import torch

from tests.workers.checks import assert_close_reduction, reduction_atol

ROWS, IN, OUT = 24, 16, 24  # tests/workers/tp_grid.py's linear: batch 8 x sequence 3 rows, 16 -> 24 features


def _weight_gradient() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, upstream, nn.Linear's weight gradient upstream^T x): a sum over the 24 rows per element."""
    gen = torch.Generator().manual_seed(1)
    x, upstream = torch.randn(ROWS, IN, generator=gen), torch.randn(ROWS, OUT, generator=gen)
    return x, upstream, upstream.T @ x


def test_a_sum_in_other_orders_and_pieces_passes() -> None:
    x, upstream, reference = _weight_gradient()
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):  # the rows in a random order, split in random pieces (ranks), the pieces summed
        order = torch.randperm(ROWS, generator=gen)
        cuts = sorted(torch.randint(1, ROWS, (3,), generator=gen).tolist())
        pieces = [upstream[rows].T @ x[rows] for rows in torch.tensor_split(order, cuts)]
        assert_close_reduction(sum(pieces), reference, terms=ROWS)


def test_the_element_that_failed_a_fixed_atol_passes() -> None:
    # the flaky run: 1.8e-6 off on an element of 1.2e-3, in a gradient whose largest element is ~15.5
    reference = torch.tensor([15.5, -3.0, 1.2e-3])
    actual = reference + torch.tensor([0.0, 0.0, 1.8e-6])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-6)
    assert_close_reduction(actual, reference, terms=ROWS)


def test_one_element_off_by_1e_4_relative_fails() -> None:
    _, _, reference = _weight_gradient()
    largest = reference.abs().argmax()
    wrong = reference.clone()
    wrong.view(-1)[largest] *= 1 + 1e-4
    with pytest.raises(AssertionError):
        assert_close_reduction(wrong, reference, terms=ROWS)
    nearest_zero = reference.abs().argmin()  # off by 1e-4 of the tensor's scale where the value is tiny
    wrong = reference.clone()
    wrong.view(-1)[nearest_zero] += 1e-4 * reference.abs().max()
    with pytest.raises(AssertionError):
        assert_close_reduction(wrong, reference, terms=ROWS)


def test_a_transposed_or_misplaced_result_fails() -> None:
    _, _, reference = _weight_gradient()  # square (24 x 16 is not): compare the 16 x 16 block with its transpose
    block = reference[:IN, :IN]
    with pytest.raises(AssertionError):
        assert_close_reduction(block.T.contiguous(), block, terms=ROWS)
    with pytest.raises(AssertionError):
        assert_close_reduction(reference.roll(1, dims=0), reference, terms=ROWS)


def test_the_tolerance_scales_with_the_terms_and_the_values() -> None:
    eps = torch.finfo(torch.float32).eps
    assert reduction_atol(torch.tensor([2.0, -4.0]), terms=16) == pytest.approx(4 * eps * 4 * 4.0)
    assert reduction_atol(torch.tensor([2.0, -4.0], dtype=torch.float64), terms=16) == pytest.approx(
        4 * torch.finfo(torch.float64).eps * 4 * 4.0
    )
