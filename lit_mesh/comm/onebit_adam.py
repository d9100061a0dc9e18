"""`OneBitAdam`: AdamW whose second moment freezes after a warm-up, so that 1-bit gradients train well.

Why (1-bit Adam, Tang et al. 2021, as in DeepSpeed): AdamW divides every coordinate by the root of its second
moment v. Sign x scale gradients give every coordinate of a block the same magnitude, so with v still updating,
every coordinate moves by about the learning rate each step in a direction that error feedback only corrects on
average: a noise floor (benchmarks/README.md, "Gradient compression"). With v frozen, the update is a fixed
diagonal preconditioner times the momentum, linear in the gradient: the error that 1-bit compression makes in
one step is sent in the next (error feedback), and the parameters follow the uncompressed run up to what the
residual holds. So: run `freeze_step` steps uncompressed (AdamW exactly), then freeze v and compress:

    MeshStrategy(grad_compression=CompressionOptions(mode="onebit", warmup_steps=10))
    OneBitAdam(model.parameters(), lr=3e-3, freeze_step=10)

Unlike DeepSpeed's 1-bit Adam the compression stays in MeshStrategy's gradient reductions (DDP all-reduce, FSDP
reduce-scatter, HSDP all-reduce), so it works with sharded parameters; the optimizer only freezes v. Written here
because torch's AdamW has no such switch (its bias correction of v keeps moving with the step count).
Its state (step, exp_avg, exp_avg_sq) is ordinary optimizer state: checkpoints hold it, and whether v is frozen
follows from the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional, overload

import torch


class OneBitAdam(torch.optim.Optimizer):
    """AdamW whose second moment freezes after `freeze_step` steps (the 1-bit Adam optimizer).

    AdamW (decoupled weight decay, torch's formula) for `freeze_step` steps, then the same update with the
    second moment `exp_avg_sq` and its bias correction frozen at their values after step `freeze_step`.

    freeze_step: optimizer steps that update the second moment; give it grad_compression's warmup_steps (the
        steps sent uncompressed), so that v holds only uncompressed gradients.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        freeze_step: int = 10,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"OneBitAdam lr={lr} must be >= 0")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"OneBitAdam betas={betas} must each be in [0, 1)")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"OneBitAdam freeze_step={freeze_step!r} must be an int >= 1 (steps that update the second moment;"
                " give it grad_compression's warmup_steps)"
            )
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step)
        )

    # torch.optim.Optimizer.step's overloads: the closure's loss back when one is given
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    # a tensor step, like torch's Adam: distributed checkpoints save it with the moments
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"].item())
                frozen = step > group["freeze_step"]
                grad, exp_avg, exp_avg_sq = p.grad, state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                if not frozen:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2 ** min(step, group["freeze_step"])
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-group["lr"] / bias_correction1)
        return loss

    def variance_frozen(self) -> bool:
        """Whether every parameter's second moment is frozen (the next step does not change it)."""
        return all(
            int(self.state[p]["step"].item()) >= g["freeze_step"]
            for g in self.param_groups
            for p in g["params"]
            if p in self.state
        ) and bool(self.state)
