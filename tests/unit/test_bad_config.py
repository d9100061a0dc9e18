"""Bad configurations fail fast with a message that names the value and the fix, never a hang."""

from __future__ import annotations

import re
import time

import pytest
from lightning.pytorch import Trainer

from lit_mesh import MeshConfigError, MeshStrategy, Topology


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "tp=0 must be >= 1"),
        ({"tp": -2}, "tp=-2 must be >= 1"),
        ({"tp": "two"}, "tp='two' must be a positive int"),
        ({"dp": 2.5}, "dp=2.5 must be a positive int or 'auto'"),
        ({"dp": "auto", "dp_shard": "auto"}, "only one degree may be 'auto'"),
        ({"pp": 2, "pp_schedule": "zigzag"}, "pp_schedule='zigzag' is not a schedule; choose one of"),
        ({"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 1}, "set pp_stages_per_rank >= 2"),
        ({"pp": 2, "pp_split": [1, 1, 2]}, "pp_split=[1, 1, 2] has 3 entries but pp=2 x stages per rank 1 = 2"),
        ({"pp": 2, "pp_microbatches": 0}, "pp_microbatches=0 must be a positive int"),
        ({"pp_schedule": "gpipe"}, "need pp > 1"),
        ({"cp": 2, "cp_style": "zigzag"}, "cp_style='zigzag'; choose one of ('ring', 'ulysses', 'allgather')"),
        ({"ep": 0}, "ep=0 must be >= 1"),
        ({"ep": 2, "ep_dispatch": "deepep"}, "ep_dispatch='deepep' is not one of ['all_to_all', 'by_node']"),
        ({"allreduce": "ring"}, "allreduce='ring'; choose one of ('auto', 'flat', 'hierarchical')"),
        ({"zero_stage": 0}, "zero_stage=0 must be 1 (sharded optimizer state), 2"),
        ({"zero_stage": True}, "zero_stage=True must be 1"),
        ({"pp": 2, "zero_stage": 1}, "zero_stage=1 with pp=2: under a pipeline"),
    ],
)
def test_degree_errors_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(MeshConfigError, match=re.escape(message)):
        MeshStrategy(**kwargs)


@pytest.mark.parametrize(
    ("devices", "kwargs", "message"),
    [
        (4, {"tp": 3}, "tp=3 = 3 does not divide the world size 4"),
        (4, {"dp": 3, "tp": 2}, "= 6, but the world size (devices x num_nodes) is 4"),
        (4, {"dp_replicate": 3}, "dp_replicate=3 does not divide the 4 ranks"),
        (4, {"dp": 2, "dp_replicate": 2, "dp_shard": 2}, "dp_replicate=2 x dp_shard=2 = 4 but dp=2"),
        (2, {"tp": 4}, "tp=4 = 4 does not divide the world size 2"),
        (4, {"dp": 4, "dp_shard": 3}, "dp_shard=3 does not divide dp=4"),
        (4, {"tp": 2, "ep": 4}, "ep=4 does not divide dp_shard x cp = 2 x 1 = 2"),
        (8, {"dp_replicate": 2, "cp": 2, "ep": 3}, "ep=3 does not divide dp_shard x cp = 2 x 2 = 4"),
        (1, {"zero_stage": 2}, "zero_stage=2 shards optimizer state and gradients over the sharded data-parallel dim"),
        (2, {"dp_replicate": 2, "zero_stage": 1}, "dp_replicate alone keeps everything whole (DDP, ZeRO stage 0)"),
    ],
)
def test_world_size_errors_before_any_process_starts(devices: int, kwargs: dict, message: str) -> None:
    start = time.monotonic()
    with pytest.raises(MeshConfigError) as error:
        Trainer(accelerator="cpu", devices=devices, strategy=MeshStrategy(**kwargs), logger=False)
    assert message in str(error.value)
    assert "choose" in str(error.value) or "give" in str(error.value)  # the fix is named
    assert time.monotonic() - start < 10


def test_tp_across_nodes_warns() -> None:
    with pytest.warns(UserWarning, match="tp=4 does not divide the 2 devices of one node"):
        Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=MeshStrategy(tp=4), logger=False)


def _slurm(nodes: int, per_node: int, ntasks: int) -> dict[str, str]:
    return {
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "1",
        "SLURM_NODELIST": "localhost",
    }


_TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "x",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
}


@pytest.mark.parametrize(
    ("trainer", "kwargs", "env", "message"),
    [
        (
            {"devices": 4},
            {"topology": Topology(nodes=2, devices_per_node=3)},
            {},
            "topology devices_per_node=3 does not divide the world size 4 (num_nodes=1 x devices=4); choose",
        ),
        (
            {"devices": 2, "num_nodes": 2},
            {"tp": 4, "strict_topology": True},
            {},
            "tp=4 does not divide the 2 devices of one node: tensor-parallel groups cross nodes",
        ),
        (
            {"devices": 4},
            {"tp": 4, "strict_topology": True, "topology": Topology(nodes=2, devices_per_node=2)},
            {},
            "choose tp dividing 2 (or strict_topology=False to run anyway)",
        ),
        (
            {"devices": 2, "num_nodes": 2},
            {"topology": Topology(nodes=4, devices_per_node=1)},
            {},
            "topology=Topology(nodes=4, devices_per_node=1) contradicts the run: LightningEnvironment and the Trainer"
            " give num_nodes=2 x devices=2; set Trainer(num_nodes=4, devices=1)",
        ),
        (
            {"devices": 2, "num_nodes": 1},
            {},
            _slurm(2, 2, 4),
            "Trainer(num_nodes=1) but the SLURM allocation has 2 nodes (SLURM_NNODES); set num_nodes=2",
        ),
        (
            {"devices": 4, "num_nodes": 2},
            {},
            _slurm(2, 2, 4),
            "Trainer(devices=4) but SLURM runs 2 tasks per node (SLURM_NTASKS_PER_NODE); set devices=2",
        ),
        (
            {"devices": 4, "num_nodes": 2},
            {},
            _slurm(2, 4, 6),
            "num_nodes=2 x devices=4 = 8 processes but SLURM runs 6 tasks (SLURM_NTASKS); the devices per node must divide",
        ),
        (
            {"devices": 2, "num_nodes": 2},
            {"topology": Topology(nodes=1, devices_per_node=4)},
            _slurm(2, 2, 4),
            "contradicts the run: SLURMEnvironment and the Trainer give num_nodes=2 x devices=2",
        ),
        (
            {"devices": 4},
            {"topology": {"nodes": 3}},
            {},
            "topology nodes=3 does not divide the world size 4 (num_nodes=1 x devices=4); choose nodes in [1, 2, 4]",
        ),
        (
            {"devices": 2},
            {"topology": {"inter_node_gbps": 25}},
            {},
            "topology keys ['inter_node_gbps'] are not Topology fields; use some of ['nodes', 'devices_per_node'",
        ),
        (
            {"devices": 2, "num_nodes": 1},
            {},
            _TORCHRUN,
            "num_nodes=1 x devices=2 = 2 but torchrun's world has 4 processes; set num_nodes=2",
        ),
    ],
)
def test_topology_errors_before_any_process_starts(
    trainer: dict, kwargs: dict, env: dict, message: str, monkeypatch
) -> None:
    """Devices per node that do not divide the world, TP larger than a node (strict), num_nodes against the
    SLURM allocation or torchrun, a topology that contradicts the environment: each named, with the fix."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MeshConfigError) as error:
        Trainer(accelerator="cpu", strategy=MeshStrategy(**kwargs), logger=False, **trainer)
    assert message in str(error.value)
    assert any(fix in str(error.value) for fix in ("choose", "set ", "give", "use "))


@pytest.mark.parametrize("precision", ["16-mixed", "64-true"])
def test_unsupported_precision_before_any_process_starts(precision: str) -> None:
    with pytest.raises(ValueError, match=f"precision='{precision}'"):
        Trainer(accelerator="cpu", devices=2, strategy=MeshStrategy(), precision=precision, logger=False)


def test_strategy_registered_by_name() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, strategy="mesh", logger=False)
    assert isinstance(trainer.strategy, MeshStrategy)
