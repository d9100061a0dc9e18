"""OneBitAdam (lit_mesh/comm/onebit_adam.py), one process: AdamW exactly until freeze_step, then the second
moment stays put and the update is linear in the gradients (what lets 1-bit error feedback work); its state
round-trips through state_dict so a resumed run continues exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from lit_mesh import OneBitAdam

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _grads(steps: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 5, generator=gen, dtype=torch.float64) * (1 + s) for s in range(steps)]


def _run(
    optimizer_cls, p0: torch.Tensor, grads: list[torch.Tensor], **kw
) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = torch.nn.Parameter(p0.clone())
    opt = optimizer_cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


def test_equals_adamw_until_the_freeze_step() -> None:
    p0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = _grads(4, 1)
    ours, _ = _run(OneBitAdam, p0, grads, freeze_step=4, **KW)
    reference, _ = _run(torch.optim.AdamW, p0, grads, foreach=False, **KW)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-14)


def test_frozen_second_moment_makes_the_update_linear_in_the_gradients() -> None:
    p0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    warm, a, b = _grads(3, 1), _grads(5, 2), _grads(5, 3)
    kw = {**KW, "weight_decay": 0.0}
    _, opt = _run(OneBitAdam, p0, warm, freeze_step=3, **kw)
    v_frozen = opt.state[opt.param_groups[0]["params"][0]]["exp_avg_sq"].clone()

    def moved(optimizer: torch.optim.Optimizer, grads: list[torch.Tensor]) -> torch.Tensor:
        o = copy.deepcopy(optimizer)
        p = o.param_groups[0]["params"][0]
        start = p.detach().clone()
        for g in grads:
            p.grad = g.clone()
            o.step()
        if isinstance(o, OneBitAdam):  # five more steps left the second moment where the freeze put it
            assert torch.equal(o.state[p]["exp_avg_sq"], v_frozen)
        return p.detach() - start

    zero = [torch.zeros_like(g) for g in a]
    summed = [x + y for x, y in zip(a, b)]
    # displacement(a + b) - displacement(0) == (displacement(a) - displacement(0)) + (displacement(b) - displacement(0))
    lhs = moved(opt, summed) - moved(opt, zero)
    rhs = moved(opt, a) + moved(opt, b) - 2 * moved(opt, zero)
    torch.testing.assert_close(lhs, rhs, rtol=1e-10, atol=1e-12)
    # AdamW from the same point is not linear: that is the difference the freeze makes
    _, adamw = _run(torch.optim.AdamW, p0, warm, foreach=False, **kw)
    lhs = moved(adamw, summed) - moved(adamw, zero)
    rhs = moved(adamw, a) + moved(adamw, b) - 2 * moved(adamw, zero)
    assert (lhs - rhs).abs().max() > 1e-4


def test_state_dict_resume_equals_the_uninterrupted_run() -> None:
    p0 = torch.randn(6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    grads = _grads(8, 4)
    full, _ = _run(OneBitAdam, p0, grads, freeze_step=3, **KW)
    half, opt = _run(OneBitAdam, p0, grads[:5], freeze_step=3, **KW)  # saved after the freeze
    assert opt.variance_frozen()
    saved = copy.deepcopy(opt.state_dict())
    p = torch.nn.Parameter(half.clone())
    resumed = OneBitAdam([p], freeze_step=3, **KW)
    resumed.load_state_dict(saved)
    for g in grads[5:]:
        p.grad = g.clone()
        resumed.step()
    assert torch.equal(p.detach(), full)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_freeze_step_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="freeze_step"):
        OneBitAdam([torch.nn.Parameter(torch.zeros(2))], freeze_step=bad)
