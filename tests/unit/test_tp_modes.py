"""tp_mode ("1d", "2d", "2.5d", "3d") as an option: checked in MeshStrategy.__init__ and before any process spawns,
reachable from the CLI; the grid shapes and the sizes the grid must divide (pure logic); what `parallelize` refuses on
a grid (torch's fake process group, one process)."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from lit_mesh.errors import MeshConfigError, PlanError
from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.options import MeshDegrees, MeshOptions, TensorOptions
from lit_mesh.parallel.apply import parallelize
from lit_mesh.parallel.grid.apply import check_grid_divides, grid_plan_problem
from lit_mesh.parallel.grid.bytes import BlockShape, bytes_1d, bytes_2_5d, bytes_2d
from lit_mesh.parallel.grid.grid import check_tp_mode, grid_shape
from tests.launch import REPO
from zoo.gpt import GPT, GPTConfig


def test_strategy_takes_tp_mode_and_turns_sequence_parallel_off() -> None:
    from lit_mesh import MeshStrategy

    options = MeshStrategy(tp=8, tp_mode="2.5d", tp_depth=2).options
    assert (options.tensor.mode, options.tensor.depth, options.mesh.sequence_parallel) == ("2.5d", 2, False)
    assert MeshStrategy(tp=4).options.tensor.mode == "1d" and MeshStrategy(tp=4).options.mesh.sequence_parallel


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=4, tp_mode="2-d"), "tp_mode='2-d' is not one of ['1d', '2d', '2.5d', '3d']"),
        (dict(tp=4, tp_mode="2d", tp_depth=2), "tp_depth=2 is the depth of tp_mode='2.5d'"),
        (dict(tp=8, tp_mode="2.5d", tp_depth=0), "tp_depth=0 must be a positive int"),
        (dict(tp=8, tp_mode="2.5d"), "tp_mode='2.5d' needs tp_depth=d >= 2 (tp = d * q * q), not None"),
        (dict(tp=6, tp_mode="2d"), "tp_mode='2d' needs tp = q * q (a q x q grid), but tp=6; use tp in [4, 9, 16, 25"),
        (dict(tp=4, tp_mode="2d", sequence_parallel=True), "tp_mode='2d' with sequence_parallel=True"),
        (dict(tp=4, tp_mode="2d", cp=2), "tp_mode='2d' with cp=2"),
        (dict(dp_replicate=2, tp=4, tp_mode="2d", grad_compression="fp16"), "tp_mode='2d' with grad_compression"),
    ],
)
def test_bad_tp_mode_is_refused_in_init(kwargs: dict, message: str) -> None:
    from lit_mesh import MeshStrategy

    with pytest.raises(MeshConfigError, match=re.escape(message)):
        MeshStrategy(**kwargs)


def test_grid_with_sharded_data_parallel_is_refused_before_spawning() -> None:
    from lightning.pytorch import Trainer

    from lit_mesh import MeshStrategy

    with pytest.raises(
        MeshConfigError, match=r"tp_mode='2d' with sharded data parallelism .*use dp_replicate=2 \(DDP\)"
    ):
        Trainer(accelerator="cpu", devices=8, strategy=MeshStrategy(tp=4, tp_mode="2d"), logger=False)
    Trainer(accelerator="cpu", devices=8, strategy=MeshStrategy(dp_replicate=2, tp=4, tp_mode="2d"), logger=False)
    with pytest.raises(MeshConfigError, match=r"tp_mode='2d' needs tp = q \* q .* but tp=2"):
        Trainer(accelerator="cpu", devices=2, strategy=MeshStrategy(tp="auto", tp_mode="2d"), logger=False)


def test_tp_mode_from_the_cli() -> None:
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    s = "--trainer.strategy.init_args."
    cli = LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=[
            "-c",
            str(REPO / "configs/gpt.yaml"),
            "--trainer.devices=4",
            "--trainer.logger=false",
            f"{s}tp=4",
            f"{s}tp_mode=2d",
            f"{s}sequence_parallel=false",
        ],
    )
    assert cli.trainer.strategy.options.tensor.mode == "2d"
    assert cli.trainer.strategy.layout.tp == 4


def test_grid_shapes() -> None:
    assert grid_shape(16, "2d", None) == (1, 4) and grid_shape(8, "2d", None) is None
    assert grid_shape(18, "2.5d", 2) == (2, 3) and grid_shape(12, "2.5d", 2) is None
    assert grid_shape(27, "3d", None) == (3, 3) and grid_shape(16, "3d", None) is None
    with pytest.raises(MeshConfigError, match="tp_depth=2.0 must be a positive int"):
        check_tp_mode("2.5d", 2.0)  # type: ignore[arg-type]


def test_grid_must_divide_heads_and_widths() -> None:
    model = GPT(GPTConfig(vocab_size=64, dim=48, n_layers=1, n_heads=6, n_kv_heads=3, ffn_hidden=96))
    grid = SimpleNamespace(q=2, depth=1, mode="2d")
    with pytest.raises(
        PlanError,
        match=r"splits n_kv_heads=3 of GPT into q=2 blocks, which does not divide it; use tp in"
        r" \[9\]",
    ):
        check_grid_divides(model, model.parallel_plan(), grid)
    check_grid_divides(model, model.parallel_plan(), SimpleNamespace(q=3, depth=1, mode="2d"))
    # a plan without `divides`: the linear layers' own widths are checked
    odd = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=90))
    plan = odd.parallel_plan()
    plan = dataclasses.replace(plan, tp=dataclasses.replace(plan.tp, divides={}))
    with pytest.raises(PlanError, match=r"splits feed_forward.w1 out_features=90 of GPT into q=4 blocks"):
        check_grid_divides(odd, plan, SimpleNamespace(q=4, depth=1, mode="2d"))


def test_formulas_agree_where_schemes_meet() -> None:
    """2.5-D of depth 1 is 2-D; 1-D is Megatron's count, 8 (p-1)/p tokens x dim elements (tests/workers/tp_grid.py
    measures the grid formulas and the 1-D one on gloo)."""
    s = BlockShape(tokens=4096, dim=1024, heads=16, kv_heads=8, ffn=4096)
    assert bytes_2_5d(s, 16, 1) == bytes_2d(s, 16)
    assert bytes_1d(s, 8) == 8 * 7 / 8 * 4096 * 1024 * 4


def test_grid_with_replicas_refuses_parameters_outside_the_plan_owners() -> None:
    """DDP beside a grid averages the gradients of the plan owners' parameters only: a parameter outside them would
    drift apart between replicas, so it is refused by name."""
    layout = MeshLayout(dp_replicate=2, tp=4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        root = nn.Module()
        root.model = GPT(GPTConfig.from_preset("tiny"))
        root.temperature = nn.Parameter(torch.ones(1))  # e.g. a learned loss scale on the LightningModule
        options = MeshOptions(mesh=MeshDegrees(sequence_parallel=False), tensor=TensorOptions("2d"))
        with pytest.raises(
            PlanError, match=r"tp_mode='2d' with dp_replicate: parameters \['temperature'\] are outside"
        ):
            parallelize(root, build_device_mesh(layout, "cpu"), options, precision="32-true")
    finally:
        dist.destroy_process_group()


def test_grid_refuses_tied_embeddings_before_applying() -> None:
    """The grid splits the embedding over the hidden dim and replicates the head: a tied pair is named (the rule
    "tp_grid_fits_plan" refuses it at setup, before any module is replaced)."""
    tied = GPT(dataclasses.replace(GPTConfig.from_preset("tiny"), tie_embeddings=True))
    problem = grid_plan_problem(tied, tied.parallel_plan(), "2d", 1, 2)
    assert problem is not None and problem.startswith("tp_mode='2d' with GPT's tied parameters")
    untied = GPT(dataclasses.replace(GPTConfig.from_preset("tiny"), tie_embeddings=False))
    assert grid_plan_problem(untied, untied.parallel_plan(), "2d", 1, 2) is None
