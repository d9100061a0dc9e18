"""Code written for Lightning's ModelParallelStrategy, run under MeshStrategy on 2 CPU ranks (gloo).

Usage: torchrun --standalone --nproc_per_node=2 tests/workers/model_parallel_compat.py OUT_DIR
Runs every scenario in one launch; each rank writes {scenario: "ok" | error text} to OUT_DIR/rank{r}.json and
tests/integration/test_model_parallel_compat.py judges. Scenarios named test_* are our copies of Lightning 2.6's
tests/tests_pytorch/strategies/test_model_parallel_integration.py (accelerator "cuda" -> "cpu", devices as there,
ModelParallelStrategy(...) -> MeshStrategy(...) with the same arguments: ModelParallelStrategy() with no argument
becomes MeshStrategy(data_parallel_size="auto", tensor_parallel_size="auto"), its meaning).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import RandomDataset
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

from lit_mesh import MeshStrategy
from lit_mesh.checkpoint import OPTIMIZER_STATE_OPTIONS
from tests.thread_police import zombie_threads
from tests.workers import exit_skipping_teardown
from tests.workers.ported import run_scenarios

OUT = Path(sys.argv[1])
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


def lightning_default() -> MeshStrategy:
    """ModelParallelStrategy() means dp = nodes, tp = devices per node: the same, in MeshStrategy's words."""
    return MeshStrategy(data_parallel_size="auto", tensor_parallel_size="auto")


# ---- the user code of Lightning's tests (our copy) ------------------------------------------------------------


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def tensor_parallel(model: FeedForward, device_mesh: Any) -> FeedForward:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
    parallelize_module(model, device_mesh["tensor_parallel"], plan)
    return model


def fsdp2_tensor_parallel(model: FeedForward, device_mesh: Any) -> FeedForward:
    from torch.distributed.fsdp import fully_shard

    tensor_parallel(model, device_mesh)
    dp_mesh = device_mesh["data_parallel"]
    assert dp_mesh.ndim == 1
    for layer in (model.w1, model.w2, model.w3):
        fully_shard(layer, mesh=dp_mesh)
    return model


class TemplateModel(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = FeedForward()

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch).sum()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters())


class FSDP2Model(TemplateModel):
    def configure_model(self) -> None:
        fsdp2_tensor_parallel(self.model, self.device_mesh)


class TensorParallelModel(TemplateModel):
    def configure_model(self) -> None:
        tensor_parallel(self.model, self.device_mesh)


# ---- ported integration tests ------------------------------------------------------------------------------------


def test_tensor_parallel(tmp: Path) -> None:
    class Model(TensorParallelModel):
        def on_train_start(self) -> None:
            mesh = self.device_mesh
            optimizer = self.optimizers()
            assert all(t.device_mesh == mesh["tensor_parallel"] for t in optimizer.param_groups[0]["params"])
            assert all(isinstance(w, DTensor) for w in self.model.parameters())
            assert self.model.w1.weight.device_mesh == mesh["tensor_parallel"]
            loader = self.trainer.train_dataloader
            assert len(loader) == 8 // loader.batch_size  # tp ranks read the same batches
            assert isinstance(loader.sampler, DistributedSampler)

        def training_step(self, batch: torch.Tensor) -> torch.Tensor:
            batches = self.all_gather(batch)
            assert all(torch.equal(batches[0], batches[i]) for i in range(1, len(batches)))
            return super().training_step(batch)

    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=lightning_default(), max_steps=2, enable_checkpointing=False, **QUIET
    )
    seed_everything(0)
    with trainer.init_module(empty_init=True):
        model = Model()
    trainer.fit(model)


def _strategy_state_dict(tmp: Path, save_distributed_checkpoint: bool) -> None:
    model = FSDP2Model()
    expected = model.state_dict()
    strategy = MeshStrategy(
        data_parallel_size="auto", tensor_parallel_size="auto", save_distributed_checkpoint=save_distributed_checkpoint
    )
    trainer = Trainer(
        default_root_dir=tmp, accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, barebones=True
    )
    trainer.fit(model)
    state = trainer.strategy.lightning_module_state_dict()
    if save_distributed_checkpoint:
        assert len(state) > 0
        assert list(state.keys()) == list(expected.keys())
    elif trainer.global_rank != 0:
        assert len(state) == 0
    else:
        assert list(state.keys()) == list(expected.keys())


def test_strategy_state_dict_sharded(tmp: Path) -> None:
    _strategy_state_dict(tmp, True)


def test_strategy_state_dict_full(tmp: Path) -> None:
    _strategy_state_dict(tmp, False)


def test_load_full_state_checkpoint_into_regular_model(tmp: Path) -> None:
    model = FSDP2Model()
    strategy = MeshStrategy(data_parallel_size="auto", tensor_parallel_size="auto", save_distributed_checkpoint=False)
    trainer = Trainer(
        default_root_dir=tmp, accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, barebones=True
    )
    trainer.fit(model)
    path = trainer.strategy.broadcast(tmp / "last.ckpt")
    trainer.save_checkpoint(path)
    model_state = trainer.strategy.lightning_module_state_dict()
    optimizer_state = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank != 0:
        assert len(model_state) == 0 and len(optimizer_state) == 0

    model = TemplateModel()
    trainer = Trainer(default_root_dir=tmp, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, **QUIET)
    trainer.fit(model, ckpt_path=path)
    restored_model = trainer.strategy.lightning_module_state_dict()
    restored_optimizer = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank == 0:
        assert len(model_state) == len(restored_model) and len(optimizer_state) == len(restored_optimizer)
        torch.testing.assert_close(model_state, restored_model, atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state, restored_optimizer, atol=0, rtol=0)
    trainer.strategy.barrier()


def test_load_standard_checkpoint_into_distributed_model(tmp: Path) -> None:
    model = TemplateModel()
    trainer = Trainer(default_root_dir=tmp, accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, **QUIET)
    trainer.fit(model)
    path = trainer.strategy.broadcast(tmp / "last.ckpt")
    trainer.save_checkpoint(path)
    model_state = trainer.strategy.lightning_module_state_dict()
    optimizer_state = trainer.strategy.optimizer_state(model.optimizers())

    model = FSDP2Model()
    strategy = MeshStrategy(data_parallel_size="auto", tensor_parallel_size="auto", save_distributed_checkpoint=False)
    trainer = Trainer(
        default_root_dir=tmp, accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, barebones=True
    )
    trainer.fit(model, ckpt_path=path)
    restored_model = trainer.strategy.lightning_module_state_dict()
    restored_optimizer = trainer.strategy.optimizer_state(model.optimizers())
    if trainer.global_rank != 0:
        assert len(restored_model) == 0 and len(restored_optimizer) == 0
    else:
        assert len(model_state) == len(restored_model) and len(optimizer_state) == len(restored_optimizer)
        torch.testing.assert_close(model_state, restored_model, atol=0, rtol=0)
        torch.testing.assert_close(optimizer_state, restored_optimizer, atol=0, rtol=0)
    trainer.strategy.barrier()


def test_save_load_sharded_state_dict(tmp: Path) -> None:
    class CheckpointModel(FSDP2Model):
        def __init__(self, params_to_compare: Any = None) -> None:
            super().__init__()
            self.params_to_compare = params_to_compare

        def on_train_start(self) -> None:
            if self.params_to_compare is None:
                return
            for p0, p1 in zip(self.params_to_compare, self.trainer.model.parameters()):
                assert torch.equal(p0, p1.full_tensor())

    seed_everything(0)
    kwargs = dict(
        default_root_dir=tmp,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = CheckpointModel()
    trainer = Trainer(**kwargs, strategy=lightning_default())
    trainer.fit(model)
    params_before = [p.full_tensor() for p in trainer.model.parameters()]
    path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    # intended difference: MeshStrategy adds .checksums.json (each file's SHA-256, verified before a load)
    assert set(os.listdir(path)) == {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp", ".checksums.json"}, (
        os.listdir(path)
    )
    metadata = torch.load(path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata
    assert len(metadata["callbacks"]) == 1
    assert "state_dict" not in metadata and "optimizer_states" not in metadata

    kwargs.update(max_epochs=2)
    model = CheckpointModel(params_to_compare=params_before)
    trainer = Trainer(**kwargs, strategy=lightning_default())
    trainer.fit(model, ckpt_path=path)


# ---- checkpoints cross between the strategies (#22) --------------------------------------------------------------


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)  # the same batches in every run, resumed or not
    return DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)), batch_size=4
    )


class UserFSDP(LightningModule):
    """Written for ModelParallelStrategy: FSDP2 over the "data_parallel" dim, in configure_model; records the
    global loss of every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.model = FeedForward()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if not any(isinstance(p, DTensor) for p in self.model.parameters()):
            for layer in (self.model.w1, self.model.w2, self.model.w3):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        world = loss.detach().clone()
        torch.distributed.all_reduce(world)
        self.losses.append(world.item() / torch.distributed.get_world_size())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


class FlattenedMesh(MeshStrategy):
    """MeshStrategy writing the flattened optimizer state (its format with pp > 1, and before #22)."""

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.model, getattr(optimizer, "_optimizer", optimizer), options=OPTIMIZER_STATE_OPTIONS
        )


STRATEGIES: dict[str, Callable[[], Any]] = {
    "mps": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    "mesh": lambda: MeshStrategy(data_parallel_size=2, tensor_parallel_size=1),
    "mesh_flat": lambda: FlattenedMesh(dp=2),
}


def _fit(strategy: str, tmp: Path, ckpt_path: Any = None, save_every: int = 0) -> list[float]:
    """4 steps; with save_every, a ModelCheckpoint writes step=2.ckpt (a save inside the loop, as in training)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = UserFSDP()
    callbacks = (
        [ModelCheckpoint(dirpath=tmp / strategy, filename="{step}", every_n_train_steps=save_every, save_top_k=-1)]
        if save_every
        else []
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=STRATEGIES[strategy](),
        max_steps=4,
        default_root_dir=tmp,
        enable_checkpointing=bool(save_every),
        callbacks=callbacks,
        **QUIET,
    )
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model.losses


def scenario_checkpoints_cross(tmp: Path) -> dict[str, Any]:
    """Each writer trains 4 steps uninterrupted, saving at step 2; each reader resumes there for steps 3-4."""
    result: dict[str, Any] = {}
    for writer in ("mps", "mesh", "mesh_flat"):
        result[writer] = _fit(writer, tmp, save_every=2)
    for writer, reader in (("mps", "mesh"), ("mesh", "mps"), ("mesh", "mesh"), ("mesh_flat", "mesh"), ("mps", "mps")):
        result[f"{writer}->{reader}"] = _fit(reader, tmp, ckpt_path=tmp / writer / "step=2.ckpt")
    stored = (
        torch.distributed.checkpoint.FileSystemReader(tmp / "mesh" / "step=2.ckpt").read_metadata().state_dict_metadata
    )
    result["mesh_writes_nested"] = "optimizer_0.param_groups.0.params" in stored
    return result


# ---- no weight silently lost (#22) --------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


def _values(factory: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)  # values no default init would draw: a lost value shows
    return {k: torch.randn_like(v) * 0.1 for k, v in factory().state_dict().items()}


class UserModel(LightningModule):
    def __init__(self, values: dict[str, torch.Tensor], load_in_configure: bool) -> None:
        super().__init__()
        self.values, self.load_in_configure = values, load_in_configure
        self.net: nn.Module | None = None
        if not load_in_configure:  # built (under trainer.init_module()) with its weights set
            self.net = Net()
            self.net.load_state_dict(values)
        self.at_start: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = Net()
            self.net.load_state_dict(self.values)

    def on_train_start(self) -> None:
        self.at_start = _full(self.net)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in module.state_dict().items()
    }


def _gpt_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (8, 17), generator=g)
    return DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)


def _zoo_module(values: dict[str, torch.Tensor], load_in_configure: bool) -> LightningModule:
    from zoo import GPTModule
    from zoo.gpt import GPT

    class ZooModel(GPTModule):
        def configure_model(self) -> None:
            if self.model is None:
                self.model = GPT(self.config)
                self.model.load_state_dict(values)

        def on_train_start(self) -> None:
            self.at_start = _full(self.model)

    module = ZooModel(lr=0.1, config_overrides={"n_layers": 1})
    if not load_in_configure:
        module.model = GPT(module.config)
        module.model.load_state_dict(values)
    return module


def scenario_weights_kept(tmp: Path) -> dict[str, Any]:
    """Trained weights with the values set (a) under trainer.init_module(), (b) by load_state_dict in
    configure_model, against the same training from weights set eagerly outside any init context."""
    from zoo.gpt import GPT, GPTConfig

    result: dict[str, Any] = {}
    user_values = _values(Net)
    zoo_values = _values(lambda: GPT(GPTConfig.from_preset("tiny", n_layers=1)))

    def train(kind: str, pattern: str, strategy: Any) -> LightningModule:
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=3,
            enable_checkpointing=False,
            default_root_dir=tmp,
            **QUIET,
        )
        load_in_configure = pattern == "configure_model"
        with trainer.init_module() if pattern == "init_module" else _nothing():
            module = (
                UserModel(user_values, load_in_configure)
                if kind == "user"
                else _zoo_module(zoo_values, load_in_configure)
            )
        trainer.fit(module, _data() if kind == "user" else _gpt_data())
        return module

    for kind, values in (("user", user_values), ("zoo", zoo_values)):
        reference = _full(getattr(train(kind, "eager", MeshStrategy()), "net" if kind == "user" else "model"))
        for pattern in ("init_module", "configure_model"):
            module = train(kind, pattern, MeshStrategy())
            net = getattr(module, "net" if kind == "user" else "model")
            result[f"{kind}/{pattern}"] = {
                "start_diff": max((module.at_start[k] - values[k]).abs().max().item() for k in values),
                "trained_diff": max((_full(net)[k] - reference[k]).abs().max().item() for k in values),
                "trained_moved": max((_full(net)[k] - values[k]).abs().max().item() for k in values),
            }
    return result


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


# ---- names and sizes (#22) ---------------------------------------------------------------------------------------


def scenario_mesh_names(tmp: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    class Probe(TemplateModel):
        def configure_model(self) -> None:
            mesh = self.device_mesh
            if mesh["tensor_parallel"].size() > 1 and not isinstance(self.model.w1.weight, DTensor):
                tensor_parallel(self.model, mesh)
            seen[self.trainer.strategy._probe] = {
                "data_parallel": mesh["data_parallel"].size(),
                "tensor_parallel": mesh["tensor_parallel"].size(),
                "both": list(mesh["data_parallel", "tensor_parallel"].shape),
            }

    for name, strategy in (
        ("lightning_auto", lightning_default()),
        ("tp_auto", MeshStrategy(tp="auto")),
        ("default", MeshStrategy()),
        ("dp_replicate2", MeshStrategy(dp_replicate=2)),
    ):
        strategy._probe = name
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=1,
            enable_checkpointing=False,
            default_root_dir=tmp,
            **QUIET,
        )
        trainer.fit(Probe())
    return seen


def scenario_16_true(tmp: Path) -> dict[str, Any]:
    """precision="16-true" as under ModelParallelStrategy: fp16 weights, FSDP over both ranks, finite losses."""
    seen: dict[str, Any] = {"losses": []}

    class Half(UserFSDP):
        def configure_model(self) -> None:  # MeshStrategy applies FSDP itself
            pass

        def training_step(self, batch: Any) -> torch.Tensor:
            seen["dtype"] = str(self.model.w1.weight.dtype)
            seen["sharded"] = isinstance(self.model.w1.weight, DTensor)
            x, y = batch
            loss = F.mse_loss(self.model(x.half()).float(), y)
            seen["losses"].append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:  # AdamW's eps=1e-8 is 0 in fp16
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MeshStrategy(),
        precision="16-true",
        max_steps=2,
        enable_checkpointing=False,
        default_root_dir=tmp,
        **QUIET,
    )
    trainer.fit(Half(), _data())
    return seen


class Watched(UserFSDP):
    """UserFSDP left to MeshStrategy's sharding. Records the names of the threads alive inside its steps; fails at `fail_at` (a step) when given."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.threads_inside: set[str] = set()

    def configure_model(self) -> None:  # MeshStrategy shards the plain model itself, once for every loop
        pass

    def _look(self) -> None:
        self.threads_inside |= {t.name for t in threading.enumerate()}

    def training_step(self, batch: Any) -> torch.Tensor:
        self._look()
        if self.global_step == self.fail_at:
            raise RuntimeError("a planned failure in training_step")
        return super().training_step(batch)

    def validation_step(self, batch: Any) -> torch.Tensor:
        self._look()
        x, y = batch
        return F.mse_loss(self.model(x), y)

    test_step = validation_step

    def predict_step(self, batch: Any) -> torch.Tensor:
        self._look()
        return self.model(batch[0])


def scenario_no_thread_left(tmp: Path) -> dict[str, Any]:
    """After fit, validate, test and predict return, and after fit ends in an exception, no thread of MeshStrategy
    runs (its HangWatch runs during them)."""
    left: dict[str, list[str]] = {}
    model = Watched()
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=MeshStrategy(dp=2), max_steps=2, default_root_dir=tmp, **QUIET
    )
    for name, call in (
        ("fit", lambda: trainer.fit(model, _data(), _data())),
        ("validate", lambda: trainer.validate(model, _data())),
        ("test", lambda: trainer.test(model, _data())),
        ("predict", lambda: trainer.predict(model, _data())),
    ):
        before = set(threading.enumerate())
        call()
        left[name] = zombie_threads(before)
    failing = Watched(fail_at=1)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=MeshStrategy(dp=2), max_steps=4, default_root_dir=tmp, **QUIET
    )
    before = set(threading.enumerate())
    try:
        trainer.fit(failing, _data())
        raised = ""
    except RuntimeError as error:
        raised = str(error)
    left["fit raising"] = zombie_threads(before)
    inside = sorted(n for n in model.threads_inside | failing.threads_inside if n.startswith("lit_mesh"))
    return {"left": left, "raised": raised, "lit_mesh_threads_inside": inside}


SCENARIOS = [
    test_tensor_parallel,
    test_strategy_state_dict_sharded,
    test_strategy_state_dict_full,
    test_load_full_state_checkpoint_into_regular_model,
    test_load_standard_checkpoint_into_distributed_model,
    test_save_load_sharded_state_dict,
    scenario_checkpoints_cross,
    scenario_weights_kept,
    scenario_mesh_names,
    scenario_16_true,
    scenario_no_thread_left,
]


def main() -> None:
    run_scenarios(SCENARIOS, OUT, set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None)


if __name__ == "__main__":
    main()
    exit_skipping_teardown()
