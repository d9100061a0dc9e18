"""fp16 mixed precision: the plugin carries the mesh's loss scaler, and without it fp16 is refused before any
process starts. The scaler's agreement over ranks: tests/integration/test_precision.py."""

from __future__ import annotations

import lightning as L
import pytest

from lit_mesh import FP16MixedPrecision, MeshStrategy
from lit_mesh.training.precision import MeshGradScaler


def test_fp16_plugin_carries_the_mesh_scaler() -> None:
    plugin = FP16MixedPrecision(device="cpu")
    assert plugin.precision == "16-mixed" and isinstance(plugin.scaler, MeshGradScaler)


def test_fp16_without_the_mesh_scaler_is_refused_before_processes_start() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.raises(ValueError, match=r"FP16MixedPrecision"):  # raised by Trainer(...): nothing spawned yet
        L.Trainer(accelerator="cpu", devices=2, strategy=MeshStrategy(), plugins=[MixedPrecision("16-mixed", "cpu")])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "fp16-plugin"])
def test_clipping_by_the_global_norm_is_mixed_into_the_chosen_plugin(precision: str) -> None:
    """The strategy keeps the user's plugin (its class, state and isinstance checks) and clips by the global norm."""
    import torch

    from lit_mesh.training.precision import GlobalNormClipping, with_global_norm_clipping

    given = FP16MixedPrecision(device="cpu") if precision == "fp16-plugin" else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MeshStrategy(),
        logger=False,
        **({"plugins": [given]} if given else {"precision": precision}),
    )
    plugin = trainer.strategy.precision_plugin
    chosen = type(plugin)
    mixed = with_global_norm_clipping(plugin)
    assert mixed is plugin and isinstance(mixed, GlobalNormClipping) and isinstance(mixed, chosen)
    assert type(with_global_norm_clipping(mixed)) is type(mixed)  # idempotent: one class per plugin class
    assert given is None or mixed is given and isinstance(mixed.scaler, MeshGradScaler)
    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.full((4,), 3.0)  # norm 6
    mixed.clip_gradients(torch.optim.SGD([weight], lr=0.1), clip_val=1.5)
    torch.testing.assert_close(weight.grad.norm(), torch.tensor(1.5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-plugin"])
def test_a_fused_optimizer_clips_without_a_loss_scale_and_is_refused_with_one(precision: str) -> None:
    """bf16-mixed has no loss scale, so a fused optimizer's gradients are true and clip (configs/gpu.yaml: fused AdamW
    on CUDA with gradient_clip_val, which Lightning's MixedPrecision refuses); with fp16's scaler they are still
    scaled at clipping time, so Lightning's refusal stands."""
    import torch

    from lit_mesh.training.precision import with_global_norm_clipping

    given = FP16MixedPrecision(device="cpu") if precision == "fp16-plugin" else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MeshStrategy(),
        logger=False,
        **({"plugins": [given]} if given else {"precision": precision}),
    )
    plugin = with_global_norm_clipping(trainer.strategy.precision_plugin)
    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.full((4,), 3.0)  # norm 6
    optimizer = torch.optim.SGD([weight], lr=0.1)
    optimizer._step_supports_amp_scaling = True  # what fused AdamW declares: it unscales inside its step
    if given is not None:
        with pytest.raises(RuntimeError, match="fused"):
            plugin.clip_gradients(optimizer, clip_val=1.5)
        return
    plugin.clip_gradients(optimizer, clip_val=1.5)
    torch.testing.assert_close(weight.grad.norm(), torch.tensor(1.5), rtol=1e-5, atol=1e-6)
