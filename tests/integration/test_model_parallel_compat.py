"""Lightning 2.6's ModelParallelStrategy integration tests with MeshStrategy in its place, and the crossings
between the two strategies, on 2 CPU ranks in one launch (tests/workers/model_parallel_compat.py). The list of
intended differences is in tests/unit/test_model_parallel_compat.py's docstring. Every scenario runs under
Lightning's zombie-thread check in each rank (tests/thread_police.py), as Lightning's conftest runs its tests."""

from __future__ import annotations

import json

import pytest
import torch

from tests.launch import launch

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="asserts CUDA devices; needs 2 GPUs")
SLOW_COMPILE = "inductor compiles for minutes on the shared 2-core CPU machine; run on a GPU machine"

# ---- integration tests (test_model_parallel_integration.py) and the crossings, on 2 ranks -------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("model_parallel_compat")
    proc = launch(2, "model_parallel_compat.py", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _value(ranks: list[dict], name: str) -> object:
    for rank, results in enumerate(ranks):
        assert results[name]["ok"], f"rank {rank}:\n{results[name]['error']}"
    return ranks[0][name]["value"]


@pytest.mark.skip(
    reason="intended difference: the mesh is N-D, 'data_parallel'/'tensor_parallel' are views (test_mesh_answers_to_lightning_names); 4 ranks"
)
def test_setup_device_mesh() -> None:
    pass


@pytest.mark.parametrize("compile", [pytest.param(True, marks=pytest.mark.skip(reason=SLOW_COMPILE)), False])
def test_tensor_parallel(ranks: list[dict], compile: bool) -> None:
    _value(ranks, "test_tensor_parallel")


@pytest.mark.skip(reason=SLOW_COMPILE)
def test_model_parallel_single_file_checkpoint_with_compile() -> None:
    pass


@pytest.mark.skip(
    reason="needs 4 ranks (dp=2 x tp=2); FSDP2 x TP under MeshStrategy runs in tests/test_lightning_features.py"
)
def test_fsdp2_tensor_parallel() -> None:
    pass


@NO_CUDA
def test_modules_without_parameters() -> None:
    pytest.fail("port on a CUDA machine: asserts torchmetrics states move to 'cuda'")


@NO_CUDA
def test_module_init_context() -> None:
    pytest.fail("port on a CUDA machine: asserts CUDA devices for 32-true, 16-true and bf16-true")


@pytest.mark.parametrize("save_distributed_checkpoint", [True, False])
def test_strategy_state_dict(ranks: list[dict], save_distributed_checkpoint: bool) -> None:
    _value(ranks, "test_strategy_state_dict_" + ("sharded" if save_distributed_checkpoint else "full"))


def test_load_full_state_checkpoint_into_regular_model(ranks: list[dict]) -> None:
    _value(ranks, "test_load_full_state_checkpoint_into_regular_model")


def test_load_standard_checkpoint_into_distributed_model(ranks: list[dict]) -> None:
    _value(ranks, "test_load_standard_checkpoint_into_distributed_model")


def test_save_load_sharded_state_dict(ranks: list[dict]) -> None:
    _value(ranks, "test_save_load_sharded_state_dict")


@pytest.mark.parametrize("move", ["mps->mesh", "mesh->mps", "mesh->mesh", "mesh_flat->mesh"])
def test_checkpoints_cross_with_the_same_next_steps(ranks: list[dict], move: str) -> None:
    """Saved at step 2 by one strategy, resumed by the other: steps 3 and 4 (the optimizer state acts on
    step 4's loss) equal the uninterrupted ModelParallelStrategy run; nested and flattened optimizer state."""
    result = _value(ranks, "scenario_checkpoints_cross")
    reference = result["mps"]  # uninterrupted
    assert len(reference) == 4 and reference[2] != reference[3]
    writer = move.split("->")[0]
    assert result[writer] == pytest.approx(reference, rel=1e-6)  # the writer's own uninterrupted run
    assert result["mps->mps"] == pytest.approx(reference[2:], rel=1e-6)  # Lightning's own resume, the baseline
    assert result[move] == pytest.approx(reference[2:], rel=1e-6)
    assert result["mesh_writes_nested"]  # Lightning's format without pp: ModelParallelStrategy reads it


@pytest.mark.parametrize("kind", ["user", "zoo"])
@pytest.mark.parametrize("pattern", ["init_module", "configure_model"])
def test_weights_set_before_training_are_kept(ranks: list[dict], kind: str, pattern: str) -> None:
    """(init_module) weights set in __init__ under trainer.init_module(); (configure_model) load_state_dict
    into the meta weights in configure_model: training starts from them, and ends where training from the
    same weights set eagerly ends."""
    result = _value(ranks, "scenario_weights_kept")[f"{kind}/{pattern}"]
    assert result["start_diff"] == 0.0
    assert result["trained_diff"] < 1e-5
    assert result["trained_moved"] > 1e-3  # it did train


def test_mesh_answers_to_lightning_names(ranks: list[dict]) -> None:
    seen = _value(ranks, "scenario_mesh_names")
    assert seen["lightning_auto"] == {"data_parallel": 1, "tensor_parallel": 2, "both": [1, 2]}
    assert seen["tp_auto"] == {"data_parallel": 1, "tensor_parallel": 2, "both": [1, 2]}
    assert seen["default"] == {"data_parallel": 2, "tensor_parallel": 1, "both": [2, 1]}
    assert seen["dp_replicate2"] == {"data_parallel": 2, "tensor_parallel": 1, "both": [2, 1]}


def test_16_true_trains_sharded_in_fp16(ranks: list[dict]) -> None:
    seen = _value(ranks, "scenario_16_true")
    assert seen["dtype"] == "torch.float16" and seen["sharded"]
    assert len(seen["losses"]) == 2 and all(0 < loss < 1e3 for loss in seen["losses"])


def test_no_thread_is_left_after_any_loop_or_an_exception(ranks: list[dict]) -> None:
    """Lightning's zombie-thread check (tests/thread_police.py) holds after each scenario above, and here after fit,
    validate, test and predict return and after fit raises; the HangWatch thread did run inside them."""
    seen = _value(ranks, "scenario_no_thread_left")
    assert seen["left"] == {name: [] for name in ("fit", "validate", "test", "predict", "fit raising")}, seen
    assert seen["raised"] == "a planned failure in training_step", seen
    assert seen["lit_mesh_threads_inside"] == ["lit_mesh.HangWatch"], seen
