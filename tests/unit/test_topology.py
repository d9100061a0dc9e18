"""Topology in one process: the cost model's formulas, the placement lines, the topology from the Trainer or
YAML, and the warning when cp crosses nodes. Simulated nodes: tests/integration/test_topology.py."""

from __future__ import annotations

import pytest

from lit_mesh import Topology
from lit_mesh.comm import allreduce_cost as cost
from lit_mesh.comm import hierarchical
from lit_mesh.mesh import MeshLayout
from tests.launch import REPO


def test_cost_model_formulas() -> None:
    """Bytes across the node boundary and inter-node steps of one ring (the figures benchmarks/topology.py measures
    on gloo), and the times of NCCL's own all-reduce (ring over every rail, tree, NVLS) against the hierarchical one."""
    s = 1000.0
    assert hierarchical.inter_node_bytes(s, 2, 4, hierarchical=False) == 2 * 7 / 8 * s
    assert hierarchical.inter_node_bytes(s, 2, 4, hierarchical=True) == 2 * 1 / 2 * s / 4
    assert (hierarchical.inter_node_steps(2, 4, False), hierarchical.inter_node_steps(2, 4, True)) == (14, 2)
    topo = Topology(nodes=64, devices_per_node=8)  # H100: NVLink 450 GB/s, 8 rails of 50 GB/s per node
    big, eff = 1e9, cost.BUS_EFFICIENCY
    rails, tree_eff = eff * 8 * 50e9, cost.TREE_EFFICIENCY  # the ring's channels use all 8 NICs of a node
    ring = 2 * (511 - 63) * 5e-6 + 2 * 63 * 15e-6 + 2 * 511 / 512 * big / rails
    tree = 2 * (7 * 5e-6 + 6 * 15e-6) + 2 * big / (tree_eff * rails)
    assert cost.ring_time(big, 64, 8, topo) == pytest.approx(ring)
    assert cost.tree_time(big, 64, 8, topo) == pytest.approx(tree)
    launch = cost.LAUNCH_LATENCY  # NCCL's base latency, once per collective
    assert hierarchical.flat_time(big, 64, 8, topo) == pytest.approx(launch + min(ring, tree))
    between = min(
        2 * 63 * 15e-6 + 2 * 63 / 64 * big / 8 / (eff * 50e9), 2 * 6 * 15e-6 + 2 * big / 8 / (tree_eff * eff * 50e9)
    )
    hier = 2 * (launch + 7 * 5e-6 + 7 / 8 * big / (eff * 450e9)) + launch + between
    assert hierarchical.hierarchical_time(big, 64, 8, topo) == pytest.approx(hier)
    # NCCL's flat all-reduce wins on an H100 node at every size: tree latency for small tensors, all rails for large
    for nbytes in (4.0, 2.0**20, big):
        assert hierarchical.flat_time(nbytes, 64, 8, topo) < hierarchical.hierarchical_time(nbytes, 64, 8, topo)
    # PCIe inside the node, fast rails: the flat ring is bound by the node's links, the hierarchy moves less on them
    pcie = Topology(nodes=64, devices_per_node=8, intra_node_bandwidth=25e9)
    assert hierarchical.hierarchical_time(big, 64, 8, pcie) < hierarchical.flat_time(big, 64, 8, pcie)
    # NVLink SHARP: the switch sums a node's ranks, each sends and receives the tensor once
    nvls = Topology(nodes=1, devices_per_node=8, nvls=True)
    assert hierarchical.flat_time(big, 1, 8, nvls) == pytest.approx(
        launch + 5e-6 + big / (cost.NVLS_ALGBW_FRACTION * 450e9)
    )
    assert hierarchical.flat_time(big, 1, 8, nvls) < launch + cost.ring_time(big, 1, 8, nvls)


def test_the_default_all_reduce_is_nccls_own() -> None:
    """allreduce defaults to "flat": FSDP2's native DDP/HSDP reduction, no Python hook, on every run."""
    import inspect

    from lit_mesh import MeshStrategy
    from lit_mesh.comm.options import CommunicationOptions

    assert CommunicationOptions().allreduce == "flat"
    assert inspect.signature(MeshStrategy).parameters["allreduce"].default == "flat"
    assert MeshStrategy(dp_replicate=2).options.communication.allreduce == "flat"


def test_placement_lines() -> None:
    text = Topology(nodes=2, devices_per_node=2).placement(MeshLayout(dp_replicate=2, tp=2))
    assert "rank    2 -> node 1, local rank 0: pp=0, dp_replicate=1, dp_shard=0, cp=0, tp=0" in text
    assert "more ranks" in Topology(nodes=16, devices_per_node=8).placement(MeshLayout(dp_shard=128))


def test_topology_from_the_trainer_with_only_the_links_given() -> None:
    from lightning.pytorch import Trainer

    from lit_mesh import MeshStrategy

    strategy = MeshStrategy(dp_replicate=4, topology=Topology(inter_node_bandwidth=25e9))
    Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, logger=False)
    assert strategy.topology == Topology(nodes=2, devices_per_node=2, inter_node_bandwidth=25e9)
    # one machine split into simulated nodes (Lightning's own launcher, num_nodes=1)
    strategy = MeshStrategy(topology=Topology(nodes=2))
    Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    assert (strategy.topology.nodes, strategy.topology.devices_per_node) == (2, 2)


def test_topology_given_as_a_mapping_or_in_yaml(tmp_path) -> None:
    """A planned config's `topology:` mapping: from Python as a dict, and from LightningCLI YAML, the run gets
    the same Topology (links kept, nodes and devices read from the Trainer)."""
    from lightning.pytorch import LightningDataModule, LightningModule, Trainer
    from lightning.pytorch.cli import LightningCLI

    from lit_mesh import MeshStrategy

    expected = Topology(nodes=1, devices_per_node=2, inter_node_bandwidth=25e9, intra_node_latency=2e-6)
    strategy = MeshStrategy(topology={"inter_node_bandwidth": 25e9, "intra_node_latency": 2e-6})
    Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert strategy.topology == expected
    config = tmp_path / "links.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: lit_mesh.MeshStrategy\n    init_args:\n      topology:\n"
        "        inter_node_bandwidth: 25.0e+9\n        intra_node_latency: 2.0e-6\n"
    )
    cli = LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["-c", str(REPO / "configs/gpt.yaml"), "-c", str(config), "--trainer.devices=2", "--trainer.logger=false"],
    )
    assert cli.trainer.strategy.topology == expected


def test_cp_across_nodes_warns() -> None:
    from lightning.pytorch import Trainer

    from lit_mesh import MeshStrategy

    with pytest.warns(UserWarning, match=r"cp=2 x tp=2 = 4 does not divide the 2 devices of one node"):
        Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=MeshStrategy(cp=2, tp=2), logger=False)


def test_startup_report_is_one_block_with_the_layout_once() -> None:
    layout = MeshLayout(dp_replicate=4, dp_shard=8, tp=4)
    text = Topology(nodes=16, devices_per_node=8).startup_report(layout, ["dp_replicate all-reduce hierarchical"])
    lines = text.splitlines()
    assert lines[0] == f"MeshStrategy: mesh {layout.describe()}"
    assert text.count(layout.describe()) == 1 and text.count("topology:") == 1
    assert "  topology: 16 node(s) x 8 device(s)" in lines and "  dp_replicate all-reduce hierarchical" in lines
    shown = [line for line in lines if " -> node " in line]
    assert len(shown) == 16 and "rank   15 -> node 1, local rank 7" in shown[-1]  # collapsed beyond 16 ranks
    assert lines[-1] == "    ... (112 more ranks, node = rank // 8)"
    small = Topology(nodes=1, devices_per_node=4).startup_report(MeshLayout(dp_shard=2, tp=2))
    assert "more ranks" not in small and sum(" -> node " in line for line in small.splitlines()) == 4
