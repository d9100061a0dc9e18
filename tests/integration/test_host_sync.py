"""A training step that logs nothing makes no host read and no collective beyond its layout's own.

One audit (lit_mesh.monitor.step_audit.StepAudit) for every layout (fsdp2, ddp2 plain and with 1-bit and PowerSGD
compression, pp2 1F1B, cp2, the zoo MoE with ep2 without and with selective AC, fsdp2 x tp2): on every rank it counts
every host sync (lit_mesh/monitor/host_syncs.py: host reads, ops that read device values, host data sent to the
device) and every
torch.distributed collective between on_train_batch_start and on_train_batch_end of step 2 (log_every_n_steps=2:
steps 1 and 3 log, step 2 does not), through the `lit-mesh` CLI (layouts in tests/workers/step_audits.py, one launch
per world size; benchmarks/host_sync.py records the same counts in benchmarks/README.md).
"""

from __future__ import annotations

import pytest

from tests.workers.step_audits import LAYOUTS, run_audits


@pytest.fixture(scope="module")
def audits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_audits(tmp_path_factory.mktemp("host_sync"))


def _world_all_reduces(ops: dict[str, int], world: int) -> int:
    return sum(n for op, n in ops.items() if op.startswith(("allreduce", "all_reduce")) and op.endswith(f"@{world}"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_that_logs_nothing_reads_nothing_on_the_host(audits: dict, layout: str) -> None:
    audit = audits[layout]
    assert len(audit["ranks"]) == audit["world_size"]
    for rank, counts in enumerate(audit["ranks"]):
        assert counts["host_syncs"] == 0, (rank, counts["host_sync_sites"])
        # MoE with ep2: each layer's all-to-all split sizes reach the host once (the one declared read), under
        # selective AC too (its recompute gets them back from the checkpoint)
        assert counts["token_count_copies"] == audit["moe_layers"], (rank, counts)
        assert sum(counts["declared_host_reads"].values()) == counts["token_count_copies"], (rank, counts)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_collective_takes_a_host_tensor(audits: dict, layout: str) -> None:
    """Every step of the run (not only the audited one): NCCL refuses a host tensor where gloo takes it."""
    found = audits[layout]["host_tensor_collectives"]
    assert found == [[]] * audits[layout]["world_size"], found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_that_logs_nothing_runs_only_its_layouts_collectives(audits: dict, layout: str) -> None:
    audit = audits[layout]
    world = audit["world_size"]
    # over the world: DDP's gradient all-reduce (one per FSDP unit: 2 blocks + the root), the MoE load statistics
    # of every MoE layer in one all-reduce, gradient clipping's global norm, PowerSGD's P, Q and uncompressed rest
    # per unit (1-bit sends all-to-alls and all-gathers instead); nothing else
    expected_world_all_reduces = {"ddp2": 3, "ddp2-powersgd": 9, "moe-ep2": 1, "moe-ep2-selective": 1, "fsdp2-clip": 1}
    expected_world_all_reduces = expected_world_all_reduces.get(layout, 0)
    for rank, counts in enumerate(audit["ranks"]):
        ops = counts["collectives"]
        assert ops, "the audit saw no collective at all"
        assert not any(op.startswith(("barrier", "monitored_barrier")) for op in ops), (rank, ops)
        assert _world_all_reduces(ops, world) == expected_world_all_reduces, (rank, ops)
        # the pipeline's loss, broadcast from the last stage once per step (every rank returns the real loss)
        broadcasts = sum(n for op, n in ops.items() if op.startswith("broadcast"))
        assert broadcasts == (1 if layout == "pp2" else 0), (rank, ops)
    if layout == "fsdp2":  # 3 FSDP units gathered in forward; backward re-gathers only block 0 (the last block
        # and the root are not resharded after forward)
        assert all(counts["collectives"]["_allgather_base_@2"] == 4 for counts in audit["ranks"])
    if layout == "fsdp2xtp2":  # tp's own all-reduces run over the tp group (2 of the 4 ranks), never the world
        assert any(op.startswith("all_reduce@2") for op in audit["ranks"][0]["collectives"])
