"""Code written for Lightning's ModelParallelStrategy runs unchanged on MeshStrategy (issue #22).

Our copies of Lightning 2.6's tests/tests_pytorch/strategies/test_model_parallel.py (unit, here) and
test_model_parallel_integration.py (2 CPU ranks, gloo, in one launch: tests/integration/test_model_parallel_compat.py
with tests/workers/model_parallel_compat.py),
with MeshStrategy in place of ModelParallelStrategy: in the constructor, and in the messages a test matches
(they name the strategy's class). `ModelParallelStrategy()` becomes
`MeshStrategy(data_parallel_size="auto", tensor_parallel_size="auto")` where the test relies on its layout
(MeshStrategy() alone means FSDP over every rank); the integration tests run with accelerator="cpu".

Lightning tests that check a ModelParallelStrategy internal MeshStrategy changes on purpose (each skipped
with its reason below, and replaced by a test of what MeshStrategy does instead):
- test_configure_model_required: MeshStrategy applies the model's parallel_plan(), so configure_model is optional.
- test_save_checkpoint_path_exists, its "not-empty-2" case: saving a sharded checkpoint over a directory that
  holds other files is refused and names them (Lightning writes into it); checkpoints are published atomically.
- test_set_timeout: it stops mesh creation by patching Lightning's _setup_device_mesh; MeshStrategy builds its
  N-D mesh with lit_mesh.mesh.build_device_mesh (the timeout reaches init_process_group all the same).
- test_meta_device_materialization: a module without reset_parameters() on the meta device is refused with an
  error naming it (Lightning warns and trains on uninitialised memory).
- test_save_load_sharded_state_dict (integration): a sharded checkpoint also holds .checksums.json (each file's
  SHA-256, written at save and verified before a load, so a damaged shard is refused by name).
- test_setup_device_mesh (integration): the mesh is N-D (pp, dp_replicate, dp_shard, cp, tp), so its
  mesh_dim_names and ndim differ; "data_parallel" and "tensor_parallel" are views of it, whatever the layout.
Not run here: the compile=True variants and test_model_parallel_single_file_checkpoint_with_compile (inductor
compiles for minutes on this shared 2-core CPU machine), test_fsdp2_tensor_parallel (4 ranks), and the tests
that assert CUDA devices (test_modules_without_parameters, test_module_init_context): they skip without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from re import escape
from unittest import mock
from unittest.mock import Mock

import pytest
import torch
import torch.nn as nn
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.environments import LightningEnvironment

from lit_mesh import MeshStrategy
from lit_mesh.init import materialize
from lit_mesh.mesh import MeshConfigError
from lit_mesh.parallel.tensor import PlanError
from tests.thread_police import no_zombie_threads


@pytest.fixture(autouse=True)
def thread_police() -> Iterator[None]:
    """Lightning's conftest check, around every test here as around Lightning's own (tests/thread_police.py)."""
    with no_zombie_threads():
        yield


NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="asserts CUDA devices; needs 2 GPUs")
SLOW_COMPILE = "inductor compiles for minutes on the shared 2-core CPU machine; run on a GPU machine"

# ---- unit tests (test_model_parallel.py) -------------------------------------------------------------------------


@mock.patch("lightning.pytorch.strategies.model_parallel._TORCH_GREATER_EQUAL_2_4", False)
def test_torch_greater_equal_2_4() -> None:
    with pytest.raises(ImportError, match="MeshStrategy requires PyTorch 2.4 or higher"):
        MeshStrategy()


def test_device_mesh_access() -> None:
    strategy = MeshStrategy()
    with pytest.raises(RuntimeError, match="Accessing the device mesh .* not allowed"):
        _ = strategy.device_mesh


@pytest.mark.parametrize(
    ("num_nodes", "devices", "invalid_dp_size", "invalid_tp_size"),
    [(1, 4, 1, 1), (1, 4, 2, 3), (1, 4, 4, 2), (2, 4, 1, 4), (2, 4, 2, 1)],
)
def test_validate_device_mesh_dimensions(
    num_nodes: int, devices: int, invalid_dp_size: int, invalid_tp_size: int
) -> None:
    strategy = MeshStrategy(data_parallel_size=invalid_dp_size, tensor_parallel_size=invalid_tp_size)
    strategy._setup_distributed = Mock()
    strategy._accelerator = Mock()
    strategy.cluster_environment = Mock(
        world_size=Mock(return_value=(num_nodes * devices)), local_rank=Mock(return_value=1)
    )
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    with pytest.raises(RuntimeError, match="multiplied should equal the world size"):
        strategy.setup_environment()


def test_fsdp_v1_modules_unsupported() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    class Model(LightningModule):
        def configure_model(self) -> None:
            pass

    model = Model()
    model.modules = Mock(return_value=[Mock(spec=FullyShardedDataParallel)])
    strategy = MeshStrategy()
    strategy.model = model
    strategy._lightning_module = model
    strategy._accelerator = Mock()
    with pytest.raises(TypeError, match="only supports the new FSDP2 APIs in PyTorch >= 2.4"):
        strategy.setup(Mock())


@pytest.mark.skip(
    reason="intended difference: MeshStrategy applies the model's parallel_plan(), configure_model is optional"
)
def test_configure_model_required() -> None:
    pass


def test_save_checkpoint_storage_options(tmp_path: Path) -> None:
    strategy = MeshStrategy()
    with pytest.raises(TypeError, match=escape("MeshStrategy.save_checkpoint(..., storage_options=...)` is not")):
        strategy.save_checkpoint(checkpoint=Mock(), filepath=tmp_path, storage_options=Mock())


@mock.patch("lightning.pytorch.strategies.model_parallel.ModelParallelStrategy.broadcast", lambda _, x: x)
@mock.patch("lightning.fabric.plugins.io.torch_io._atomic_save")
@mock.patch("lightning.pytorch.strategies.model_parallel.shutil")
def test_save_checkpoint_path_exists(shutil_mock: Mock, torch_save_mock: Mock, tmp_path: Path) -> None:
    """Lightning's test without its "not-empty-2" case (see test_save_checkpoint_path_exists_with_other_files)."""
    strategy = MeshStrategy(save_distributed_checkpoint=False)
    path = tmp_path / "not-empty"
    path.mkdir()
    (path / "file").touch()
    assert not _is_sharded_checkpoint(path)
    with pytest.raises(IsADirectoryError, match="exists and is a directory"):
        strategy.save_checkpoint(Mock(), filepath=path)

    path = tmp_path / "sharded-checkpoint"
    path.mkdir()
    (path / "meta.pt").touch()
    assert _is_sharded_checkpoint(path)
    strategy.save_checkpoint(Mock(), filepath=path)
    shutil_mock.rmtree.assert_called_once_with(path)

    path = tmp_path / "file.pt"
    path.touch()
    torch_save_mock.reset_mock()
    strategy.save_checkpoint(Mock(), filepath=path)
    torch_save_mock.assert_called_once()

    strategy = MeshStrategy(save_distributed_checkpoint=True)
    save_mock = mock.patch("torch.distributed.checkpoint.save")
    path = tmp_path / "file-2.pt"
    path.touch()
    with save_mock:
        strategy.save_checkpoint({"state_dict": {}, "optimizer_states": {"": {}}}, filepath=path)
    assert path.is_dir()


@pytest.mark.skip(
    reason="intended difference: a sharded save over a directory with other files is refused, naming them"
)
def test_save_checkpoint_path_exists_not_empty_2() -> None:
    pass


@mock.patch("lightning.fabric.strategies.model_parallel._has_dtensor_modules", return_value=True)
def test_load_unknown_checkpoint_type(_: Mock, tmp_path: Path) -> None:
    strategy = MeshStrategy()
    strategy.model = Mock()
    strategy._lightning_module = Mock(strict_loading=True)
    path = tmp_path / "empty_dir"
    path.mkdir()
    with pytest.raises(ValueError, match="does not point to a valid checkpoint"):
        strategy.load_checkpoint(checkpoint_path=path)


@pytest.mark.skip(
    reason="intended difference: MeshStrategy builds its N-D mesh itself (see test_timeout_reaches_init_process_group)"
)
def test_set_timeout() -> None:
    pass


@pytest.mark.skip(
    reason="intended difference: a meta module without reset_parameters() is refused (see test_meta_module_without_reset_is_named)"
)
def test_meta_device_materialization() -> None:
    pass


def test_align_compiled_param_names_with_module() -> None:
    """Lightning's helper, which MeshStrategy's single-file optimizer state goes through (inherited)."""
    from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module

    module = nn.Module()
    module.model = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)))
    names = ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    state = {"state": {n: {"step": 1} for n in names}, "param_groups": [{"params": list(names), "lr": 0.01}]}
    result = _align_compiled_param_names_with_module(state, module)
    expected = {n.replace("model.", "model._orig_mod.") for n in names}
    assert set(result["state"]) == expected == set(result["param_groups"][0]["params"])
    assert set(result["state"]) == {name for name, _ in module.named_parameters()}


def test_align_compiled_param_names_no_compile() -> None:
    from lightning.pytorch.strategies.model_parallel import _align_compiled_param_names_with_module

    module = nn.Module()
    module.model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    state = {"state": {"model.0.weight": {"step": 1}, "model.0.bias": {"step": 1}}}
    assert set(_align_compiled_param_names_with_module(state, module)["state"]) == {"model.0.weight", "model.0.bias"}


# ---- what MeshStrategy does instead, and the other #22 items (in-process) ------------------------------------------


@mock.patch("torch.distributed.init_process_group")
def test_timeout_reaches_init_process_group(init_process_group_mock: Mock) -> None:
    strategy = MeshStrategy(timeout=timedelta(seconds=30))
    strategy._lightning_module = Mock()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = Mock()
    with mock.patch("lit_mesh.strategy.build_device_mesh") as build:
        build.return_value.dp_cp.size.return_value = 1
        build.return_value.layout.dp_replicate = 1
        strategy.setup_environment()
    init_process_group_mock.assert_called_with(
        "gloo", rank=0, world_size=1, timeout=timedelta(seconds=30), device_id=None
    )


def test_meta_module_without_reset_is_named() -> None:
    class NoResetParameters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, 4))

    with torch.device("meta"):
        model = nn.Sequential(NoResetParameters(), nn.Linear(4, 4))
    with pytest.raises(PlanError, match=r"NoResetParameters \(built on the meta device outside configure_model"):
        materialize(model, [], torch.device("cpu"))


def test_overwriting_a_directory_with_other_files_is_refused_naming_them(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    path.mkdir()
    for name in ("meta.pt", ".metadata", "__0_0.distcp", "notes.txt"):
        (path / name).touch()
    (path / "plots").mkdir()
    (path / "plots" / "loss.png").touch()
    strategy = MeshStrategy()
    with pytest.raises(FileExistsError, match=escape("not part of a checkpoint (notes.txt, plots/loss.png)")):
        strategy.save_checkpoint({"state_dict": {}}, filepath=path)
    assert (path / "notes.txt").exists() and (path / "meta.pt").exists()  # nothing deleted
    single_file = MeshStrategy(save_distributed_checkpoint=False)  # Lightning would rmtree the directory
    with pytest.raises(FileExistsError, match="notes.txt"):
        single_file.save_checkpoint({"state_dict": {}}, filepath=path)
    assert (path / "notes.txt").exists()


def test_lightning_sizes_and_tp_auto_resolve_like_model_parallel_strategy() -> None:
    def layout(strategy: MeshStrategy, nodes: int, devices: int) -> tuple[int, int]:
        strategy.num_nodes, strategy.parallel_devices = nodes, [torch.device("cpu")] * devices
        return strategy.layout.dp, strategy.layout.tp

    assert layout(MeshStrategy(data_parallel_size="auto", tensor_parallel_size="auto"), 2, 4) == (2, 4)
    assert layout(MeshStrategy(tensor_parallel_size=2, data_parallel_size=4), 2, 4) == (4, 2)
    assert layout(MeshStrategy(tensor_parallel_size="auto"), 3, 2) == (3, 2)  # the other one defaults to "auto"
    assert layout(MeshStrategy(tp="auto"), 2, 4) == (2, 4)  # tp = devices per node, dp fills the rest
    assert layout(MeshStrategy(), 2, 4) == (8, 1)  # MeshStrategy's own default stays: FSDP over every rank
    with pytest.raises(MeshConfigError, match="together with tp=2"):
        MeshStrategy(tp=2, data_parallel_size=2)
    with pytest.raises(MeshConfigError, match="tensor_parallel_size=0 must be >= 1"):
        MeshStrategy(tensor_parallel_size=0)


def test_16_true_is_accepted_and_refusals_offer_only_valid_choices() -> None:
    from lightning.pytorch.plugins.precision import DoublePrecision

    from lit_mesh.training.precision import check_precision_plugin

    trainer = Trainer(accelerator="cpu", devices=1, strategy=MeshStrategy(), precision="16-true", logger=False)
    assert str(trainer.precision_plugin.precision) == "16-true"
    with pytest.raises(ValueError, match="precision='64-true'") as lightning_error:  # Lightning's own check
        Trainer(accelerator="cpu", devices=2, strategy=MeshStrategy(), precision="64-true", logger=False)
    with pytest.raises(ValueError, match="precision='64-true'") as our_error:  # a plugin reaches ours
        check_precision_plugin(DoublePrecision())
    offered = str(lightning_error.value).split("among: ")[1].rstrip(".").split(", ")
    offered += str(our_error.value).split(" in (")[1].split(")")[0].replace("'", "").split(", ")
    assert "16-true" in offered
    for choice in set(offered):  # each offered choice is accepted
        Trainer(accelerator="cpu", devices=1, strategy=MeshStrategy(), precision=choice, logger=False)
