"""Multi-node on one host: two simulated SLURM nodes (SLURM_* set per process, as srun sets them) and two
torchrun invocations with --nnodes 2 sharing one rendezvous. The topology read from the environment, TP and
node-local groups, hierarchical == flat all-reduce (DDP, HSDP, layered compression), GPT training parity."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from lit_mesh import Topology
from lit_mesh.comm import hierarchical
from lit_mesh.mesh import MeshLayout
from tests.launch import REPO, WORKERS

# launcher variables of the test's own environment must not leak into the simulated ranks
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _LAUNCHER_VARS}
    return {**env, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired as e:
        for proc in procs:
            proc.kill()
        raise AssertionError(f"timed out after {timeout}s") from e
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-6000:]
    return outputs


def slurm_launch(nodes: int, per_node: int, script: Path, *args: str, timeout: float = 240) -> None:
    """One process per SLURM task on localhost, with the variables srun would set."""
    port, world = free_port(), nodes * per_node
    procs = []
    for rank in range(world):
        env = clean_env(
            SLURM_NTASKS=str(world), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
            SLURM_NODEID=str(rank // per_node), SLURM_NNODES=str(nodes), SLURM_NTASKS_PER_NODE=str(per_node),
            SLURM_JOB_NAME="lit-mesh-test", SLURM_JOB_ID="4242", SLURM_NODELIST="localhost",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
        cmd = [sys.executable, str(script), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      cwd=tempfile.mkdtemp(prefix="lit-mesh-test-")))  # fmt: skip
    wait_all(procs, timeout)


def torchrun_nodes(nodes: int, per_node: int, script: Path, *args: str, timeout: float = 300) -> list[str]:
    """`torchrun --nnodes N --node-rank i` once per simulated node, all on this host, one static rendezvous."""
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
            f"--nproc-per-node={per_node}", "--master-addr=127.0.0.1", f"--master-port={port}", str(script), *args,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      cwd=tempfile.mkdtemp(prefix="lit-mesh-test-")))  # fmt: skip
    return wait_all(procs, timeout)


@pytest.mark.parametrize("per_node", [2, 4])
def test_slurm_two_nodes_topology_groups_and_hierarchical_equals_flat(tmp_path: Path, per_node: int) -> None:
    """2 nodes x 2 tasks, and 2 x 4: there HSDP 4 x 2 has two replicas per node, so its replicate all-reduce has a
    real node-local step (at 2 x 2 it has one replica per node and the hierarchy is trivial)."""
    slurm_launch(2, per_node, WORKERS / "topology_units.py", str(tmp_path), timeout=120 * per_node)
    for rank in range(2 * per_node):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        failed = {name: error for name, error in results.items() if error != "ok"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{n}:\n{e}" for n, e in failed.items())
        assert len(results) == 8, results


def test_cost_model_formulas() -> None:
    """Bytes across the node boundary and inter-node steps (the figures benchmarks/topology.py measures)."""
    s = 1000.0
    assert hierarchical.inter_node_bytes(s, 2, 4, hierarchical=False) == 2 * 7 / 8 * s
    assert hierarchical.inter_node_bytes(s, 2, 4, hierarchical=True) == 2 * 1 / 2 * s / 4
    assert (hierarchical.inter_node_steps(2, 4, False), hierarchical.inter_node_steps(2, 4, True)) == (14, 2)
    topo = Topology(nodes=64, devices_per_node=8)
    big = 1e9  # a 1 GB gradient: bandwidth-bound, the inter-node bytes shrink ~g times
    flat, hier = hierarchical.flat_time(big, 64, 8, topo), hierarchical.hierarchical_time(big, 64, 8, topo)
    assert flat == pytest.approx(2 * 511 * 15e-6 + 2 * 511 / 512 * big / 50e9)
    assert hier == pytest.approx(2 * (7 * 5e-6 + 7 / 8 * big / 450e9) + 2 * 63 * 15e-6 + 2 * 63 / 64 * big / 8 / 50e9)
    assert flat / hier > 4


def test_placement_lines() -> None:
    text = Topology(nodes=2, devices_per_node=2).placement(MeshLayout(dp_replicate=2, tp=2))
    assert "rank    2 -> node 1, local rank 0: pp=0, dp_replicate=1, dp_shard=0, cp=0, tp=0" in text
    assert "more ranks" in Topology(nodes=16, devices_per_node=8).placement(MeshLayout(dp_shard=128))


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


S = "--trainer.strategy.init_args."
STEPS = 5
GPT = [
    "-c", str(REPO / "configs/gpt.yaml"), "--trainer.num_nodes=2", "--trainer.devices=2", f"--trainer.max_steps={STEPS}",
    "--trainer.log_every_n_steps=1", "--trainer.logger=CSVLogger", "--data.global_batch_size=8", "--seed_everything=0",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.enable_checkpointing=false",
    "--trainer.limit_val_batches=0", f"{S}dp_replicate=4", "--trainer.callbacks+=lit_mesh.MeshMonitor",
]  # fmt: skip


def test_torchrun_two_nodes_gpt_hierarchical_equals_flat(tmp_path: Path) -> None:
    """torchrun --nnodes 2 --node-rank 0/1 on one host: TorchElasticEnvironment's topology, the node-local groups,
    and the zoo GPT on DDP 4 training the same with the hierarchical all-reduce as with the flat one (gradients
    and the synced train_loss), and close with fp16 compression on the inter-node step only."""
    runs = [
        {"name": "flat", "args": [*GPT, f"{S}allreduce=flat"]},
        {"name": "hierarchical", "args": [*GPT, f"{S}allreduce=hierarchical"]},
        {"name": "layered_fp16", "args": [*GPT, f"{S}allreduce=auto", f"{S}grad_compression=fp16"]},
        # DDP 2 x TP 2: every TP group inside one node, the replicas across the nodes
        {"name": "ddp2_tp2", "args": [*GPT, f"{S}dp_replicate=2", f"{S}tp=2", f"{S}strict_topology=true"]},
    ]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    outputs = torchrun_nodes(2, 2, WORKERS / "topology_runs.py", str(tmp_path), str(spec))
    # rank 0 (node 0's torchrun) prints where every rank sits
    assert "rank    3 -> node 1, local rank 1: pp=0, dp_replicate=3, dp_shard=0, cp=0, tp=0" in outputs[0], outputs[0][-3000:]
    assert "dp_replicate all-reduce hierarchical: 2 nodes x 2 ranks per node" in outputs[0]
    assert outputs[0].count("(world size 4;") == 4, "the layout is printed once per run (one block), not twice"
    results = {r["name"]: json.loads((tmp_path / r["name"] / "result.json").read_text()) for r in runs}

    flat_ranks, hier_ranks = results["flat"]["ranks"], results["hierarchical"]["ranks"]
    for rank, facts in enumerate(hier_ranks):
        assert facts["environment"] == "TorchElasticEnvironment"
        assert (facts["topology"]["nodes"], facts["topology"]["devices_per_node"]) == (2, 2)
        assert facts["rank"] == [rank, rank // 2, rank % 2]
        node = [2 * (rank // 2), 2 * (rank // 2) + 1]  # the node's ranks; the peer on the other node
        for dim in ("dp_replicate", "dp_cp"):
            assert facts["hierarchies"][dim] == {"intra": node, "inter": sorted([rank % 2, rank % 2 + 2])}, facts
    assert all(not facts["hierarchies"] for facts in flat_ranks)  # flat makes no groups

    def losses(name: str) -> list[float]:
        by_step = results[name]["metrics"]["train_loss"]
        return [by_step[k] for k in sorted(by_step, key=int)]

    assert len(losses("flat")) == STEPS
    torch.testing.assert_close(losses("hierarchical"), losses("flat"), rtol=1e-5, atol=0)
    flat_params = torch.load(tmp_path / "flat" / "params.pt")
    hier_params = torch.load(tmp_path / "hierarchical" / "params.pt")
    for name, p in flat_params.items():
        torch.testing.assert_close(hier_params[name], p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses("layered_fp16"), losses("flat"), rtol=1e-3, atol=0)
    for rank, facts in enumerate(results["ddp2_tp2"]["ranks"]):
        assert facts["tp_nodes"] == [rank // 2], (rank, facts["tp_nodes"])
    torch.testing.assert_close(losses("ddp2_tp2"), losses("flat"), rtol=1e-4, atol=0)

    # MeshMonitor's bytes per group: the cross-node group carries 1/3 of the flat all-reduce's bytes
    # (2(n-1)/n·S/g = S/2 against 2(N-1)/N·S = 3S/2), the node-local one the other 2/3
    def mib(name: str, dim: str) -> float:
        by_step = results[name]["metrics"][f"monitor/comm_mib/{dim}"]
        return by_step[max(by_step, key=int)]

    flat = mib("flat", "dp_replicate")
    assert mib("hierarchical", "dp_replicate:inter") == pytest.approx(flat / 3, rel=0.02)
    assert mib("hierarchical", "dp_replicate:intra") == pytest.approx(flat * 2 / 3, rel=0.02)
    # left on the flat replicate group (here the world): only the non-finite-loss check, 4 floats
    assert mib("hierarchical", "dp_replicate") * 2**20 == 2 * 3 / 4 * 16


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
    config.write_text("trainer:\n  strategy:\n    class_path: lit_mesh.MeshStrategy\n    init_args:\n      topology:\n"
                      "        inter_node_bandwidth: 25.0e+9\n        intra_node_latency: 2.0e-6\n")
    cli = LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                       args=["-c", str(REPO / "configs/gpt.yaml"), "-c", str(config), "--trainer.devices=2",
                             "--trainer.logger=false"])  # fmt: skip
    assert cli.trainer.strategy.topology == expected


def test_cp_across_nodes_warns() -> None:
    from lightning.pytorch import Trainer

    from lit_mesh import MeshStrategy

    with pytest.warns(UserWarning, match=r"cp=2 x tp=2 = 4 does not divide the 2 devices of one node"):
        Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=MeshStrategy(cp=2, tp=2), logger=False)
