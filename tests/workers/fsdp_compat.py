"""Code written for Lightning's FSDPStrategy, run under MeshStrategy on 2 CPU ranks (gloo), in one launch.

Usage: python tests/fork_launch.py 2 tests/workers/fsdp_compat.py OUT_DIR [SCENARIO,...]
Each rank writes {scenario: {"ok", "error" | "value"}} to OUT_DIR/rank{r}.json; tests/integration/test_fsdp_compat.py
judges. The scenarios are our copies of Lightning 2.6's tests/tests_pytorch/strategies/test_fsdp.py tests that train,
save, load or wrap: accelerator "gpu"/"cuda" -> "cpu", FSDPStrategy(...) -> MeshStrategy(...) with the same arguments
("fsdp" -> MeshStrategy()). The intended differences are listed in tests/integration/test_fsdp_compat.py's docstring;
here each is marked "intended difference" where it is made.
"""

from __future__ import annotations

import os
import sys
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from lightning.fabric.utilities.load import _load_distributed_checkpoint
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, always_wrap_policy, size_based_auto_wrap_policy, wrap
from torch.distributed.tensor import DTensor

from lit_mesh import MeshStrategy
from lit_mesh.training.precision import FP16MixedPrecision
from tests.workers import exit_skipping_teardown
from tests.workers.ported import run_scenarios

OUT = Path(sys.argv[1])
# intended difference: FSDPStrategy writes a full checkpoint by default, MeshStrategy a sharded one; where a test
# relies on FSDPStrategy's default ("fsdp", or no state_dict_type), the port names it: state_dict_type="full"
FSDP_DEFAULT = {"state_dict_type": "full"}

# intended difference: FSDP2 keeps no dtype for buffers, and reduces gradients in fp32 under fp16/bf16 compute
# (FSDP1 under Lightning reduces in the compute dtype); 32-true gives FSDP2's default policy (the parameters' dtype)
PARAM_AND_REDUCE_DTYPE = {
    "32-true": (None, None),
    "16-mixed": (torch.float16, torch.float32),
    "bf16-mixed": (torch.bfloat16, torch.float32),
}


def precision_arguments(precision: str) -> dict[str, Any]:
    """intended difference: MeshStrategy takes fp16 mixed precision as its plugin (with a loss scaler that agrees
    over the ranks): Lightning refuses the string "16-mixed" for ModelParallelStrategy and its subclasses."""
    if precision == "16-mixed":
        return {"plugins": [FP16MixedPrecision("cpu")]}
    return {"precision": precision}


def assert_unit(module: nn.Module, precision: str) -> None:
    """FSDP1's `isinstance(m, FullyShardedDataParallel)` and `m.mixed_precision` -> FSDP2's unit and its policy."""
    assert isinstance(module, FSDPModule), type(module)
    policy = module._get_fsdp_state()._mp_policy  # type: ignore[operator]
    assert (policy.param_dtype, policy.reduce_dtype) == PARAM_AND_REDUCE_DTYPE[precision], policy


class BatchHooks(BoringModel):
    """The batch hooks both of Lightning's FSDP test models define (written once here): fp32 batches, and the layer's
    FSDP units checked after every batch."""

    def _assert_layer_fsdp_instance(self) -> None:
        raise NotImplementedError

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        assert batch.dtype == torch.float32

    def on_train_batch_end(self, _: Any, batch: torch.Tensor, batch_idx: int) -> None:
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_test_batch_end(self, _: Any, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_validation_batch_end(self, _: Any, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()

    def on_predict_batch_end(self, _: Any, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        assert batch.dtype == torch.float32
        self._assert_layer_fsdp_instance()


class TestFSDPModel(BatchHooks):
    def __init__(self) -> None:
        super().__init__()
        self.layer: Optional[nn.Module] = None

    def _init_model(self) -> None:
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    def configure_model(self) -> None:
        if self.layer is None:
            self._init_model()
        # the model is already wrapped with FSDP: no need to wrap again!
        if isinstance(self.layer, FSDPModule):  # FSDP1: FullyShardedDataParallel
            return
        for i, layer in enumerate(self.layer):
            if i % 2 == 0:
                self.layer[i] = wrap(layer)
        self.layer = wrap(self.layer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.layer.parameters(), lr=0.1)  # type: ignore[union-attr]

    def _assert_layer_fsdp_instance(self) -> None:
        # intended difference: no FSDPPrecision plugin check (MeshStrategy keeps Lightning's precision plugins)
        precision = self.trainer.precision
        assert_unit(self.layer, precision)  # type: ignore[arg-type]
        for layer_num in [0, 2]:
            assert_unit(self.layer[layer_num], precision)  # type: ignore[index]  # FSDP1: self.layer.module[n]


class TestBoringModel(BoringModel):
    def __init__(self, wrap_min_params: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.should_be_wrapped = [wrap_min_params < (32 * 32 + 32), None, wrap_min_params < (32 * 2 + 2)]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class TestFSDPModelAutoWrapped(TestBoringModel, BatchHooks):
    def _assert_layer_fsdp_instance(self) -> None:
        assert isinstance(self.layer, torch.nn.Sequential)
        for layer_num in [0, 2]:
            if not self.should_be_wrapped[layer_num]:
                # this layer is not wrapped
                assert not isinstance(self.layer[layer_num], FSDPModule)
                continue
            assert_unit(self.layer[layer_num], self.trainer.precision)


def _run_multiple_stages(trainer: Trainer, model: BoringModel, model_path: Optional[str] = None) -> None:
    trainer.fit(model)
    trainer.test(model)

    model_path = trainer.strategy.broadcast(model_path)
    path = Path(model_path if model_path else trainer.checkpoint_callback.last_model_path)  # type: ignore[union-attr]

    # Save another checkpoint after testing, without optimizer states
    trainer.save_checkpoint(path.with_name("after-test"))
    trainer.save_checkpoint(path, weights_only=True)

    if not path.is_dir():  # Lightning: equality of sharded checkpoints is not asserted
        _assert_save_equality(trainer, path, cls=model.__class__)

    with torch.inference_mode():
        trainer.test(model)  # model is wrapped, will not call `configure_model`
        trainer.test(ckpt_path=path)  # loads into the model
        trainer.predict(model)
        trainer.predict(ckpt_path=path)


def _assert_save_equality(trainer: Trainer, ckpt_path: Path, cls: type = TestFSDPModel) -> None:
    model_state_dict = trainer.strategy.lightning_module_state_dict()
    if trainer.is_global_zero:
        saved_model = cls.load_from_checkpoint(ckpt_path)
        assert len(model_state_dict) == len(saved_model.state_dict()) > 0
        for ddp_param, shard_param in zip(model_state_dict.values(), saved_model.state_dict().values()):
            assert torch.equal(ddp_param, shard_param)


# ---- ported tests ----------------------------------------------------------------------------------------------------


def test_strategy_sync_batchnorm(tmp_path: Path) -> None:
    model = TestFSDPModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=MeshStrategy(**FSDP_DEFAULT),  # "fsdp"
        precision="32-true",
        max_epochs=1,
        sync_batchnorm=True,
    )
    _run_multiple_stages(trainer, model, os.path.join(tmp_path, "last.ckpt"))


def _strategy_checkpoint(tmp_path: Path, state_dict_type: str, precision: str) -> None:
    model = TestFSDPModel()
    strategy = MeshStrategy(state_dict_type=state_dict_type)
    trainer = Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
        **precision_arguments(precision),
    )  # fmt: skip
    _run_multiple_stages(trainer, model, os.path.join(tmp_path, "last.ckpt"))


def test_strategy_checkpoint_sharded_32_true(tmp_path: Path) -> None:
    _strategy_checkpoint(tmp_path, "sharded", "32-true")


def test_strategy_checkpoint_full_32_true(tmp_path: Path) -> None:
    _strategy_checkpoint(tmp_path, "full", "32-true")


def custom_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return nonwrapped_numel >= 2


def _size_wrapped_trainer(tmp_path: Path, wrap_min_params: int) -> Trainer:
    """The Trainer of Lightning's size-policy tests (written once here): units by parameter count, fp16 mixed."""
    strategy = MeshStrategy(
        auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=wrap_min_params), **FSDP_DEFAULT
    )
    return Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, barebones=True,
        **precision_arguments("16-mixed"),
    )  # fmt: skip


def _assert_equal_states(
    model_state: dict, optimizer_state: dict, restored_model: dict, restored_optimizer: dict
) -> None:
    assert len(model_state) == len(restored_model)
    assert len(optimizer_state) == len(restored_optimizer)
    torch.testing.assert_close(model_state, restored_model, atol=0, rtol=0)
    torch.testing.assert_close(optimizer_state, restored_optimizer, atol=0, rtol=0)


def _strategy_full_state_dict(tmp_path: Path, wrap_min_params: int) -> None:
    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    correct_state_dict = model.state_dict()  # State dict before wrapping

    trainer = _size_wrapped_trainer(tmp_path, wrap_min_params)
    trainer.fit(model)

    full_state_dict = trainer.strategy.lightning_module_state_dict()
    if trainer.global_rank != 0:
        assert len(full_state_dict) == 0
        return
    assert len(correct_state_dict) == len(full_state_dict)
    assert all(_ex == _co for _ex, _co in zip(full_state_dict.keys(), correct_state_dict.keys()))


def test_strategy_full_state_dict_2(tmp_path: Path) -> None:
    _strategy_full_state_dict(tmp_path, 2)


def test_strategy_full_state_dict_1024(tmp_path: Path) -> None:
    _strategy_full_state_dict(tmp_path, 1024)


def test_strategy_full_state_dict_100000000(tmp_path: Path) -> None:
    _strategy_full_state_dict(tmp_path, 100000000)


def _checkpoint_multi_gpus(tmp_path: Path, model: BoringModel, strategy: Any) -> None:
    ck = ModelCheckpoint(save_last=True)
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="32-true",
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=2,
        limit_test_batches=2,
        limit_predict_batches=2,
        callbacks=[ck],
    )
    _run_multiple_stages(trainer, model)


def test_checkpoint_multi_gpus_manually_wrapped(tmp_path: Path) -> None:
    _checkpoint_multi_gpus(tmp_path, TestFSDPModel(), MeshStrategy(**FSDP_DEFAULT))


def test_checkpoint_multi_gpus_autowrap_2x(tmp_path: Path) -> None:
    _checkpoint_multi_gpus(
        tmp_path, TestFSDPModelAutoWrapped(), MeshStrategy(auto_wrap_policy=custom_auto_wrap_policy, **FSDP_DEFAULT)
    )


def test_checkpoint_multi_gpus_autowrap_use_orig_params(tmp_path: Path) -> None:
    strategy = MeshStrategy(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True, **FSDP_DEFAULT)
    _checkpoint_multi_gpus(tmp_path, TestFSDPModelAutoWrapped(), strategy)


def _invalid_parameters_in_optimizer(tmp_path: Path, use_orig_params: Optional[bool]) -> None:
    fsdp_kwargs = {} if use_orig_params is None else {"use_orig_params": use_orig_params}
    trainer = Trainer(
        default_root_dir=tmp_path, strategy=MeshStrategy(**fsdp_kwargs), accelerator="cpu", devices=2, fast_dev_run=1
    )

    class EmptyParametersModel(BoringModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    trainer.fit(EmptyParametersModel())

    class NoFlatParametersModel(BoringModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            layer = torch.nn.Linear(4, 5)
            return torch.optim.Adam(layer.parameters(), lr=1e-2)

    # intended difference: FSDP1 with use_orig_params=False refuses an optimizer without its FlatParameters; FSDP2
    # has none (its parameters are the model's own, as DTensors), so there is nothing to refuse in every case
    trainer.fit(NoFlatParametersModel())


def test_invalid_parameters_in_optimizer_none(tmp_path: Path) -> None:
    _invalid_parameters_in_optimizer(tmp_path, None)


def test_invalid_parameters_in_optimizer_false(tmp_path: Path) -> None:
    _invalid_parameters_in_optimizer(tmp_path, False)


def test_invalid_parameters_in_optimizer_true(tmp_path: Path) -> None:
    _invalid_parameters_in_optimizer(tmp_path, True)


def _strategy_save_optimizer_states(tmp_path: Path, wrap_min_params: int) -> None:
    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    trainer = _size_wrapped_trainer(tmp_path, wrap_min_params)
    trainer.fit(model)
    model_path = trainer.strategy.broadcast(os.path.join(tmp_path, "last.ckpt"))
    trainer.save_checkpoint(model_path)

    model_state_dict = trainer.strategy.lightning_module_state_dict()
    optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank != 0:
        assert len(model_state_dict) == 0
        assert len(optimizer_state_dict) == 0

    # restore model to ddp
    model = TestBoringModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1)
    trainer.fit(model, ckpt_path=model_path)
    restored_model_state_dict = trainer.strategy.lightning_module_state_dict()
    restored_optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank == 0:
        _assert_equal_states(
            model_state_dict, optimizer_state_dict, restored_model_state_dict, restored_optimizer_state_dict
        )
    trainer.strategy.barrier()


def test_strategy_save_optimizer_states_2(tmp_path: Path) -> None:
    _strategy_save_optimizer_states(tmp_path, 2)


def test_strategy_save_optimizer_states_1024(tmp_path: Path) -> None:
    _strategy_save_optimizer_states(tmp_path, 1024)


def test_strategy_save_optimizer_states_100000000(tmp_path: Path) -> None:
    _strategy_save_optimizer_states(tmp_path, 100000000)


def _strategy_load_optimizer_states(tmp_path: Path, wrap_min_params: int) -> None:
    # restore model to ddp
    model = TestBoringModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1)
    trainer.fit(model)
    model_path = trainer.strategy.broadcast(os.path.join(tmp_path, "last.ckpt"))
    trainer.save_checkpoint(model_path)
    model_state_dict = trainer.strategy.lightning_module_state_dict()
    optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())

    model = TestFSDPModelAutoWrapped(wrap_min_params=wrap_min_params)
    trainer = _size_wrapped_trainer(tmp_path, wrap_min_params)
    trainer.fit(model, ckpt_path=model_path)
    restored_model_state_dict = trainer.strategy.lightning_module_state_dict()
    restored_optimizer_state_dict = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank != 0:
        assert len(restored_model_state_dict) == 0
        assert len(restored_optimizer_state_dict) == 0
    if trainer.global_rank == 0:
        _assert_equal_states(
            model_state_dict, optimizer_state_dict, restored_model_state_dict, restored_optimizer_state_dict
        )
    trainer.strategy.barrier()


def test_strategy_load_optimizer_states_2(tmp_path: Path) -> None:
    _strategy_load_optimizer_states(tmp_path, 2)


def test_strategy_load_optimizer_states_1024(tmp_path: Path) -> None:
    _strategy_load_optimizer_states(tmp_path, 1024)


def test_strategy_load_optimizer_states_100000000(tmp_path: Path) -> None:
    _strategy_load_optimizer_states(tmp_path, 100000000)


def test_configure_model(tmp_path: Path) -> None:
    precision, expected_dtype = "32-true", torch.float32
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=MeshStrategy(auto_wrap_policy=always_wrap_policy),
        precision=precision,
        max_epochs=1,
        enable_checkpointing=False,
        logger=False,
    )

    class MyModel(BoringModel):
        def configure_model(self) -> None:
            self.layer = torch.nn.Linear(32, 2)
            # intended difference: MeshStrategy calls configure_model on the meta device and draws each rank's shard
            # after sharding (Lightning: "The model is on the CPU until after `.setup()`", a TODO there)
            assert self.layer.weight.device == torch.device("meta")
            assert self.layer.weight.dtype == expected_dtype

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.layer.parameters(), lr=0.1)

        def on_fit_start(self) -> None:
            # Parameters get sharded in `.setup()` and moved to the target device ("cuda", local_rank there)
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == expected_dtype
            assert isinstance(self.layer, FSDPModule)  # always_wrap_policy: the layer is a unit of its own

    trainer.fit(MyModel())


class TestFSDPCheckpointModel(BoringModel):
    def __init__(self, params_to_compare: Any = None) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        self.params_to_compare = params_to_compare

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def on_train_start(self) -> None:
        if self.params_to_compare is None:
            return
        for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters()):
            # FSDP1's flat parameters are plain tensors; FSDP2's are DTensors, compared whole
            torch.testing.assert_close(_whole(p0), _whole(p1), atol=0, rtol=0, equal_nan=True)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


SHARDED_FILES = {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp", ".checksums.json"}  # intended: checksums


def test_save_load_sharded_state_dict(tmp_path: Path) -> None:
    strategy = MeshStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    trainer_kwargs: dict[str, Any] = {
        "default_root_dir": tmp_path,
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
    }
    model = TestFSDPCheckpointModel()
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model)
    params_before = deepcopy(list(trainer.model.parameters()))  # type: ignore[union-attr]

    checkpoint_path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))  # type: ignore[union-attr]
    assert set(os.listdir(checkpoint_path)) == SHARDED_FILES, os.listdir(checkpoint_path)

    metadata = torch.load(checkpoint_path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(metadata["callbacks"]) == 1  # model checkpoint callback
    assert "state_dict" not in metadata
    assert "optimizer_states" not in metadata

    trainer_kwargs.update(max_epochs=2)
    model = TestFSDPCheckpointModel(params_to_compare=params_before)
    strategy = MeshStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")
    trainer = Trainer(**trainer_kwargs, strategy=strategy)
    trainer.fit(model, ckpt_path=checkpoint_path)


def _module_init_context(tmp_path: Path, precision: str, expected_dtype: torch.dtype) -> None:
    class Model(BoringModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def on_train_start(self) -> None:
            # Parameters get sharded in `setup()` and moved to the target device ("cuda", local_rank there)
            assert self.layer.weight.device == torch.device("cpu")
            assert self.layer.weight.dtype == expected_dtype
            optimizer = self.optimizers(use_pl_optimizer=False)
            assert optimizer.param_groups[0]["params"][0].device.type == "cpu"

    def _run_setup_assertions(empty_init: bool, expected_device: torch.device) -> None:
        trainer = Trainer(
            default_root_dir=tmp_path,
            accelerator="cpu",
            devices=2,
            strategy=MeshStrategy(auto_wrap_policy={torch.nn.Linear}),
            precision=precision,
            max_steps=1,
            barebones=True,
            enable_checkpointing=False,
            logger=False,
        )
        with trainer.init_module(empty_init=empty_init):
            model = Model()
        # The model is on the CPU/meta-device until after `setup()`
        assert model.layer.weight.device == expected_device
        assert model.layer.weight.dtype == expected_dtype
        trainer.fit(model)

    _run_setup_assertions(empty_init=False, expected_device=torch.device("cpu"))
    _run_setup_assertions(empty_init=True, expected_device=torch.device("meta"))


def test_module_init_context_32_true(tmp_path: Path) -> None:
    _module_init_context(tmp_path, "32-true", torch.float32)


def test_module_init_context_bf16_true(tmp_path: Path) -> None:
    _module_init_context(tmp_path, "bf16-true", torch.bfloat16)


def test_save_sharded_and_consolidate_and_load(tmp_path: Path) -> None:
    class CustomModel(BoringModel):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.1)

    model = CustomModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=2,
        strategy=MeshStrategy(auto_wrap_policy=always_wrap_policy, state_dict_type="sharded"),
        max_steps=3,
    )
    trainer.fit(model)

    checkpoint_path_sharded = trainer.strategy.broadcast(str(trainer.checkpoint_callback.best_model_path))  # type: ignore[union-attr]
    assert set(os.listdir(checkpoint_path_sharded)) == SHARDED_FILES, os.listdir(checkpoint_path_sharded)

    # consolidate the checkpoint to a single file
    checkpoint_path_full = trainer.strategy.broadcast(str(tmp_path / "checkpoint_full.ckpt"))
    if trainer.global_rank == 0:
        checkpoint = _load_distributed_checkpoint(Path(checkpoint_path_sharded))
        checkpoint = _format_checkpoint(checkpoint)
        torch.save(checkpoint, checkpoint_path_full)
    trainer.strategy.barrier()

    model = CustomModel()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", devices=2, strategy="ddp", max_steps=4)
    trainer.fit(model, ckpt_path=checkpoint_path_full)


SCENARIOS = [fn for name, fn in list(globals().items()) if name.startswith("test_") and callable(fn)]
# run only when named on the command line: it fails on rank 0 alone (a known gap, see the integration test), and the
# ranks would then wait in different collectives until the launch's timeout
KNOWN_GAPS = {"test_save_sharded_and_consolidate_and_load"}


def main() -> None:
    only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None
    run_scenarios([s for s in SCENARIOS if only or s.__name__ not in KNOWN_GAPS], OUT, only)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
