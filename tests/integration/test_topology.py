"""Multi-node on one host: two simulated SLURM nodes (SLURM_* set per process, as srun sets them) and two
torchrun invocations with --nnodes 2 sharing one rendezvous. The topology read from the environment, TP and
node-local groups, hierarchical == flat all-reduce (DDP, HSDP, layered compression), GPT training parity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.launch import LAUNCHER_VARIABLES, REPO, WORKERS, free_port, launch_with_environments
from tests.worker_checks import CheckResults, check_names, selected_checks


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCHER_VARIABLES}
    return {
        **env,
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "ignore",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


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
    """One rank per SLURM task on localhost, with the variables srun would set (forked from one interpreter)."""
    port, world = free_port(), nodes * per_node
    environments = [
        clean_env(
            SLURM_NTASKS=str(world),
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank % per_node),
            SLURM_NODEID=str(rank // per_node),
            SLURM_NNODES=str(nodes),
            SLURM_NTASKS_PER_NODE=str(per_node),
            SLURM_JOB_NAME="lit-mesh-test",
            SLURM_JOB_ID="4242",
            SLURM_NODELIST="localhost",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        for rank in range(world)
    ]
    proc = launch_with_environments(environments, script, *args, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def torchrun_nodes(nodes: int, per_node: int, script: Path, *args: str, timeout: float = 300) -> list[str]:
    """`torchrun --nnodes N --node-rank i` once per simulated node, all on this host, one static rendezvous."""
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={per_node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(script),
            *args,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                env=clean_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tempfile.mkdtemp(prefix="lit-mesh-test-"),
            )
        )
    return wait_all(procs, timeout)


@pytest.fixture(scope="module", params=[2, 4], ids=["2x2", "2x4"])
def slurm_two_nodes(request: pytest.FixtureRequest) -> CheckResults:
    """2 nodes x 2 tasks, and 2 x 4: there HSDP 4 x 2 has two replicas per node, so its replicate all-reduce has a
    real node-local step (at 2 x 2 it has one replica per node and the hierarchy is trivial)."""
    per_node, out = request.param, request.getfixturevalue("tmp_path_factory").mktemp("topology_units")
    checks = ",".join(selected_checks(request))
    slurm_launch(2, per_node, WORKERS / "topology_units.py", str(out), checks, timeout=120 * per_node)
    return CheckResults(out, 2 * per_node)


@pytest.mark.parametrize("check", check_names("topology_units.py"))
def test_slurm_two_nodes(slurm_two_nodes: CheckResults, check: str) -> None:
    """The topology read from SLURM, TP and node-local groups, hierarchical == flat all-reduce (DDP, HSDP, layered
    compression), on two simulated SLURM nodes."""
    slurm_two_nodes.assert_passed(check)


S = "--trainer.strategy.init_args."
STEPS = 5
GPT = [
    "-c",
    str(REPO / "configs/gpt.yaml"),
    "--trainer.num_nodes=2",
    "--trainer.devices=2",
    f"--trainer.max_steps={STEPS}",
    "--trainer.log_every_n_steps=1",
    "--trainer.logger=CSVLogger",
    "--data.global_batch_size=8",
    "--seed_everything=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.limit_val_batches=0",
    f"{S}dp_replicate=4",
    "--trainer.callbacks+=lit_mesh.MeshMonitor",
]


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
    assert "rank    3 -> node 1, local rank 1: pp=0, dp_replicate=3, dp_shard=0, cp=0, tp=0" in outputs[0], outputs[0][
        -3000:
    ]
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


MOE = [
    "-c",
    str(REPO / "configs/moe.yaml"),
    *GPT[2:-2],  # two nodes x 2 devices, the same steps and batches
]
# transformers' Mixtral (zoo.hf.HFCausalLM), through lit_mesh's adapter of its MoE block
HF_MIXTRAL = [
    "-c",
    str(REPO / "configs/gpt.yaml"),
    "--model=zoo.hf.HFCausalLM",
    "--model.init_args.architecture=mixtral",
    *GPT[2:-2],
]


def test_torchrun_two_nodes_moe_by_node_dispatch_equals_all_to_all(tmp_path: Path) -> None:
    """configs/moe.yaml on torchrun --nnodes 2: ep_dispatch="by_node" (each token once per destination node, forwarded
    inside the node) trains as the all-to-all dispatch does: ep 4 over both nodes, whole experts under tp (ep 4 over
    dp_shard 2 x tp 2), expert tensor parallel (tp 2 x ep 2: one rank per node in each ep group) and compiled blocks
    under selective AC; and transformers' Mixtral with ep 4 over both nodes."""
    runs = [
        {"name": "ep4", "args": [*MOE, f"{S}ep=4"]},
        {"name": "ep4_by_node", "args": [*MOE, f"{S}ep=4", f"{S}ep_dispatch=by_node"]},
        {
            "name": "tp2_ep4_fold_by_node",
            "args": [*MOE, f"{S}tp=2", f"{S}ep=4", f"{S}expert_tp=1", f"{S}ep_dispatch=by_node"],
        },
        {"name": "tp2_ep2_by_node", "args": [*MOE, f"{S}tp=2", f"{S}ep=2", f"{S}ep_dispatch=by_node"]},
        # compiled blocks under selective AC (the dispatch itself runs eagerly)
        {
            "name": "ep4_by_node_compiled_selective",
            "args": [
                *MOE,
                f"{S}ep=4",
                f"{S}ep_dispatch=by_node",
                f"{S}compile_blocks=true",
                f"{S}compile_backend=aot_eager",
                f"{S}activation_checkpointing=selective",
            ],
        },
        # step 2 (which logs nothing) audited: no host read but both stages' split sizes, no host tensor in a collective
        {
            "name": "ep4_by_node_audited",
            "args": [
                *MOE,
                f"{S}ep=4",
                f"{S}ep_dispatch=by_node",
                "--trainer.log_every_n_steps=2",
                "--trainer.callbacks+=lit_mesh.monitor.step_audit.StepAudit",
                "--trainer.callbacks.init_args.step=2",
                f"--trainer.callbacks.init_args.out={tmp_path / 'audit.json'}",
                "--trainer.callbacks+=tests.collective_devices.CollectiveDevices",
                f"--trainer.callbacks.init_args.out={tmp_path / 'collective_devices'}",
                "--trainer.callbacks.init_args.skip_steps=[2]",  # not in the audited step
            ],
        },
        {"name": "hf_mixtral_ep4", "args": [*HF_MIXTRAL, f"{S}ep=4"]},
        {"name": "hf_mixtral_ep4_by_node", "args": [*HF_MIXTRAL, f"{S}ep=4", f"{S}ep_dispatch=by_node"]},
    ]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    torchrun_nodes(2, 2, WORKERS / "topology_runs.py", str(tmp_path), str(spec))
    results = {r["name"]: json.loads((tmp_path / r["name"] / "result.json").read_text()) for r in runs}

    def losses(name: str) -> list[float]:
        by_step = results[name]["metrics"]["train_loss"]
        return [by_step[k] for k in sorted(by_step, key=int)]

    assert len(losses("ep4")) == STEPS
    assert all(facts["dispatchers"] == ["AllToAllDispatch"] for facts in results["ep4"]["ranks"])
    audit = json.loads((tmp_path / "audit.json").read_text())
    for rank, counts in enumerate(audit["ranks"]):
        assert counts["host_syncs"] == 0, (rank, counts["host_sync_sites"])
        assert counts["token_count_copies"] == 2 * audit["moe_layers"], (rank, counts)  # between and inside nodes
    for rank in range(4):
        found = json.loads((tmp_path / "collective_devices" / f"rank{rank}.json").read_text())
        assert found == [], (rank, found)  # NCCL refuses a host tensor where gloo takes it
    by_node = ("ep4_by_node", "tp2_ep4_fold_by_node", "tp2_ep2_by_node", "ep4_by_node_compiled_selective")
    pairs = [(name, "ep4") for name in by_node]
    for name, flat in [*pairs, ("hf_mixtral_ep4_by_node", "hf_mixtral_ep4")]:
        assert all(facts["dispatchers"] == ["ByNodeDispatch"] for facts in results[name]["ranks"]), name
        torch.testing.assert_close(losses(name), losses(flat), rtol=1e-4, atol=0, msg=name)
        reference = torch.load(tmp_path / flat / "params.pt")
        params = torch.load(tmp_path / name / "params.pt")
        for key, p in reference.items():
            torch.testing.assert_close(params[key], p, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
