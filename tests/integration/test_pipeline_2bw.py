"""PipeDream-2BW (`pp_schedule="2bw"`) on 3 gloo ranks, one stage each (warm-ups 2, 1, 0: the first, a middle and
the last stage), in one launch (tests/workers/pipeline_2bw.py): the zoo GPT's losses and final weights equal, exactly,
one process applying the same delayed rule W_{t+1} = W_t - update(grad f(W_{t-1}; batch t-1)) to the whole model;
the curve is not the synchronous one; each stage holds two weight versions at most; a run resumed from a checkpoint
restarts the delay line, as documented (lit_mesh/parallel/pipeline/twobw.py). 4 ranks pass the same checks (run the
worker with --nproc_per_node=4); 3 keep the suite's time down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import launch

WORLD = 3
EXACT = 1e-6  # relative; the pipeline does the same float operations in the same order (bit-equal when measured)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out: Path = tmp_path_factory.mktemp("pipeline_2bw")
    proc = launch(WORLD, "pipeline_2bw.py", str(out), timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads((out / "result.json").read_text())


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_losses_and_weights_follow_the_delayed_rule_exactly(result: dict) -> None:
    assert result["world"] == WORLD
    losses, reference = result["losses"], result["delayed_losses"]
    assert len(losses) == len(reference) == 10 and len(set(reference)) == 10
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert _close(got, want, EXACT), f"step {step}: pipeline {got} vs delayed reference {want}"
    assert result["param_names_match"], "every stage's parameters, under the whole model's names"
    assert result["param_max_abs_diff"] <= EXACT * result["param_max_abs"], result["param_max_abs_diff"]


def test_it_is_not_the_synchronous_curve(result: dict) -> None:
    """Step 0 runs W_0 in both; from step 1 on the synchronous run has applied one more update than 2bw."""
    losses, sync = result["losses"], result["sync_losses"]
    assert _close(losses[0], sync[0], EXACT)
    for step in range(1, len(sync)):
        assert not _close(losses[step], sync[step], 10 * EXACT), f"step {step}: {losses[step]} is the synchronous loss"


def test_at_most_two_weight_versions_per_stage(result: dict) -> None:
    """Distinct storages holding a stage's weights (live parameters and the versions its pending backwards use):
    two copies during training, one once fit() has drained the pipeline."""
    assert sorted(result["storage"]) == [str(r) for r in range(WORLD)]
    for rank, measured in result["storage"].items():
        for step, (held, one_copy) in enumerate(measured["per_step"]):
            assert one_copy > 0 and held == 2 * one_copy, (rank, step, held, one_copy)
        held, one_copy = measured["after_fit"]
        assert held == one_copy, (rank, held, one_copy)


def test_resume_restarts_the_delay_line(result: dict) -> None:
    """The checkpoint at step 5 holds W_5 and the optimizer state; batch 4's gradient was in flight and is not
    saved, so the resumed run's first step applies no update: the replay that drops it there, exactly."""
    resumed, expected = result["resumed_losses"], result["restarted_losses"]
    assert len(resumed) == len(expected) == 5
    for got, want in zip(resumed, expected):
        assert _close(got, want, EXACT), (resumed, expected)


def test_point_to_point_batched_without_a_host_read_per_message(result: dict) -> None:
    """As NCCL needs it (#33 item 3): every send and receive of the fit went through batch_isend_irecv, a batch that
    receives talks to one peer, and the activation header was read on the host once per stage that receives (one
    micro-batch shape in the run), not per message."""
    assert sorted(result["p2p"]) == [str(r) for r in range(WORLD)]
    for rank, p2p in result["p2p"].items():
        assert p2p["unbatched"] == [], (rank, p2p["unbatched"])
        assert p2p["mixed_peer_receives"] == [], (rank, p2p["mixed_peer_receives"])
        assert p2p["batches"] > 0, rank
        assert p2p["host_reads"] == (0 if rank == "0" else 1), (rank, p2p["host_reads"])
