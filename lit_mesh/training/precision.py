"""fp16 mixed precision with dynamic loss scaling for MeshStrategy.

Lightning refuses `precision="16-mixed"` for ModelParallelStrategy and its subclasses, so fp16 comes as a
plugin: `Trainer(plugins=[FP16MixedPrecision()], strategy=MeshStrategy(...))`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override

from lit_mesh.training.grad_norm import clip_grad_norm_
from lit_mesh.unit import Facts, Rule, enforce

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-true", "16-mixed")
# what Trainer(precision=...) accepts with MeshStrategy ("16-mixed" only comes as the FP16MixedPrecision plugin:
# Lightning refuses the string for ModelParallelStrategy and its subclasses)
TRAINER_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor  # a DTensor's shard


class MeshGradScaler(torch.amp.GradScaler):
    """A GradScaler whose overflow check agrees over every rank.

    torch's own cannot serve a mesh: one foreach call cannot take DTensor gradients of different meshes
    (FSDP-only and FSDP x TP parameters), and its DTensor rule reduces the overflow flag over one mesh's
    sharded dims only. Here each rank checks and unscales its local shards, then the flag is all-reduced
    (max) over the world, so every rank skips the same steps and the scale stays the same everywhere.
    """

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grad = _local(param.grad)
                    by_dtype[grad.dtype].append(grad)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return {found_inf.device: found_inf}


class FP16MixedPrecision(MixedPrecision):
    """fp16 mixed precision with dynamic loss scaling that agrees over every rank.

    fp16 compute (autocast, and FSDP2 gathers fp16 parameters), fp32 master weights and gradient
    reduction, dynamic loss scaling with a rank-consistent overflow check.

    Args:
        device: autocast device type; default "cuda" when a GPU is present, else "cpu".
        init_scale: first loss scale.
        growth_interval: steps without overflow before the scale doubles.
    """

    def __init__(self, device: Optional[str] = None, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        scaler = MeshGradScaler(device, init_scale=init_scale, growth_interval=growth_interval)
        super().__init__("16-mixed", device, scaler=scaler)


RULES: list[Rule] = [
    Rule(
        "precision_supported",
        "launch",
        lambda f: f.precision not in SUPPORTED_PRECISION,
        lambda f: (
            f"MeshStrategy does not support precision={f.precision!r}; choose Trainer(precision=...) in"
            f" {TRAINER_PRECISION}, or fp16 mixed precision with plugins=[lit_mesh.FP16MixedPrecision()]"
        ),
        ValueError,
    ),
    Rule(
        "fp16_needs_mesh_scaler",
        "launch",
        lambda f: (
            f.precision == "16-mixed" and not isinstance(getattr(f.precision_plugin, "scaler", None), MeshGradScaler)
        ),
        lambda f: (
            "precision='16-mixed' under MeshStrategy needs a loss scaler that agrees over all ranks:"
            " pass plugins=[lit_mesh.FP16MixedPrecision()] (and leave precision unset)"
        ),
        ValueError,
    ),
]


def check_precision_plugin(plugin: Precision) -> None:
    """Check the precision plugin alone, before processes start.

    The precision alone (RULES), before processes start: a precision MeshStrategy can shard, and fp16 only with
    its scaler.
    """
    facts = Facts(precision=str(plugin.precision), precision_plugin=plugin)
    for rule in RULES:
        enforce(rule, facts)


class GlobalNormClipping(Precision):
    """Clipping by the true global norm of sharded gradients, for the run's precision plugin.

    Clipping by the true global norm, mixed into the run's precision plugin by MeshStrategy (`with_global_norm_
    clipping`): Lightning's default cannot mix DTensors of different meshes. Pipeline stages hold different
    parameters, so their norms also add up over `stage_group` (None without pipeline).
    """

    stage_group: Optional[dist.ProcessGroup] = None
    pipeline: Any = None  # the run's PipelineRunner: which parameters this rank counts in the norm (tied copies once)

    @override
    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if getattr(self, "scaler", None) is None:
            # no loss scale (bf16-mixed): the gradients are true, so a fused optimizer (which would unscale inside
            # its step) clips fine; Lightning's MixedPrecision refuses it regardless (seen on an H100, configs/gpu.yaml)
            Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        params = list(self.main_params(optimizer))
        counted = self.pipeline.norm_parameters(params) if self.pipeline is not None else params
        clip_grad_norm_(params, float(clip_val), across=self.stage_group, norm_of=counted)


_CLIPPING_CLASSES: dict[type, type] = {}


def with_global_norm_clipping(plugin: Precision) -> Precision:
    """The user's precision plugin with global-norm clipping mixed in.

    The plugin the user chose (Trainer(precision=...) or plugins=[...]) as a subclass of its own class with
    GlobalNormClipping first: same object, same state (e.g. FP16MixedPrecision's scaler), same isinstance checks.
    """
    cls = type(plugin)
    if not isinstance(plugin, GlobalNormClipping):
        if cls not in _CLIPPING_CLASSES:
            _CLIPPING_CLASSES[cls] = type(cls.__name__, (GlobalNormClipping, cls), {"__module__": cls.__module__})
        plugin.__class__ = _CLIPPING_CLASSES[cls]
    return plugin
