"""Context parallel: exact attention over a sequence split across ranks, and the same loss curve as one device.

Attention level: ring, Ulysses and all-gather against torch's full SDPA (fp32, max abs error 1e-5 on the output
and on dq, dk, dv), causal and not, cp 2 and 4, multi-head and grouped-query K/V (one 4-rank launch).
Model level: the zoo GPT through the `lit-mesh` CLI on cp2 (ring, Ulysses, all-gather), cp4, cp2 x tp2 and
fsdp2 x cp2 against the single-device run (relative 1e-4 per step over 10 steps, validation loss, final
parameters 1e-4): gradients averaged over cp ranks that each hold T/cp tokens of the same samples must give
the global-token mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_mesh.parallel.context import (
    ContextParallelAttention,
    ContextParallelError,
    _swap_attention,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from lit_mesh.parallel.context_attention import _ring_block
from tests.launch import REPO, cli_runs, torchrun
from tests.test_parity import COMMON, STEPS, _assert_same_curve, losses

S = "--trainer.strategy.init_args."
# one validation batch at the last step: val_loss parity too (the same sharding serves validation)
VALIDATE = ["--trainer.val_check_interval=10", "--trainer.limit_val_batches=1", "--trainer.num_sanity_val_steps=0"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "cp2": (2, [f"{S}cp=2"]),
    "cp2_ulysses": (2, [f"{S}cp=2", f"{S}cp_style=ulysses"]),
    "cp2_allgather": (2, [f"{S}cp=2", f"{S}cp_style=allgather"]),
    "cp2_ac_selective": (2, [f"{S}cp=2", f"{S}activation_checkpointing=selective"]),  # recompute runs the ring again
    "cp4": (4, [f"{S}cp=4"]),
    "cp2_tp2": (4, [f"{S}cp=2", f"{S}tp=2"]),
    "fsdp2_cp2": (4, [f"{S}cp=2", f"{S}dp=2"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("cp_parity")
    found: dict[str, dict] = {}
    for nproc in (1, 2, 4):
        runs = [
            {"name": name, "args": ["-c", str(REPO / "configs/gpt.yaml"), f"--trainer.devices={n}", *COMMON, *VALIDATE, *extra]}
            for name, (n, extra) in LAYOUTS.items()
            if n == nproc
        ]
        found.update(cli_runs(nproc, out, runs, timeout=400))
    found["_dir"] = {"path": str(out)}
    return found


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single"])
def test_context_parallel_matches_single_device(results: dict, layout: str) -> None:
    reference, candidate = results["single"], results[layout]
    assert candidate["world_size"] == LAYOUTS[layout][0]
    ref_losses = losses(reference)
    assert len(set(ref_losses)) == STEPS, "the reference run must actually update the model"
    _assert_same_curve(ref_losses, losses(candidate), layout)
    (ref_val,), (val,) = reference["metrics"]["val_loss"].values(), candidate["metrics"]["val_loss"].values()
    assert abs(val - ref_val) <= 1e-4 * ref_val, f"{layout}: val_loss {val} vs single-device {ref_val}"

    out = Path(results["_dir"]["path"])
    ref_params = torch.load(out / "single" / "params.pt", weights_only=True)
    params = torch.load(out / layout / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys()
    for name, ref in ref_params.items():
        diff = (params[name] - ref).abs().max().item()
        assert diff <= 1e-4, f"{layout}: parameter {name} differs by {diff}"


@pytest.fixture(scope="module")
def attention_errors(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("cp_attention") / "errors.json"
    proc = torchrun(4, "cp_attention.py", str(out), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


# the ring's per-block kernel: torch's fused CPU flash kernel by default here; "-math" the plain math GPUs use
STYLES = ["ring", "ring-math", "ulysses", "allgather"]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mask", ["causal", "full"])
@pytest.mark.parametrize("kv_heads", [8, 2])  # 8 query heads: multi-head, and grouped-query (4 per kv head)
def test_attention_matches_full_attention(attention_errors: dict, cp: int, style: str, mask: str, kv_heads: int) -> None:
    style, _, kernel = style.partition("-")
    errors = attention_errors[f"cp{cp}-{style}-{mask}-kv{kv_heads}" + (f"-{kernel}" if kernel else "")]
    for what, error in zip(("output", "dq", "dk", "dv"), errors):
        assert error <= 1e-5, f"{what}: max abs error {error}"


def test_attention_refuses_what_it_cannot_split(attention_errors: dict) -> None:
    assert "6 query heads on this rank (after tp) are not divisible by cp=4; choose cp in [1, 2, 3, 6]" in attention_errors["ulysses_heads"]
    assert "sequence length is 12; use a sequence length that is a multiple of 8" in attention_errors["ring_length"]


@pytest.mark.parametrize("style", ["ring", "ulysses", "allgather"])
def test_predictions_come_back_whole_and_in_order(attention_errors: dict, style: str) -> None:
    assert attention_errors[f"gather_{style}"] is True


# ---- the layout of the sequence (no processes) ------------------------------------------------------------


@pytest.mark.parametrize("balanced", [True, False])
def test_shards_and_positions_cover_the_sequence(balanced: bool) -> None:
    cp, length = 4, 16
    x = torch.arange(length).repeat(2, 1)  # (batch, sequence)
    shards = [shard_sequence(x, cp, rank, balanced) for rank in range(cp)]
    assert torch.equal(unshard_sequence(shards, balanced), x)
    for rank, shard in enumerate(shards):  # the positions a rank is told are those of the tokens it holds
        assert torch.equal(local_positions(length // cp, cp, rank, balanced), shard[0])
    if balanced:  # rank 0 holds the first and the last chunk
        assert shards[0][0].tolist() == [0, 1, 14, 15]


def test_load_balanced_ring_gives_every_rank_the_same_work() -> None:
    cp, length = 4, 8  # local length: two chunks of 4
    for step in range(cp):
        work = set()
        for rank in range(cp):
            rows, cols, causal = _ring_block((rank - step) % cp, rank, True, length)
            cells = (rows.stop - rows.start) * (cols.stop - cols.start)
            work.add(cells / 2 if causal else cells)  # a causal block computes about half its cells
        assert len(work) == 1, f"step {step}: unequal work {work}"


def test_sequence_not_divisible_is_refused_with_the_fix() -> None:
    with pytest.raises(ContextParallelError, match="sequence length is 66; use a sequence length that is a multiple of 8"):
        shard_sequence(torch.zeros(2, 66), 4, 0, load_balanced=True)
    with pytest.raises(ContextParallelError, match="cp = 4 shards, but the sequence length is 66"):
        shard_sequence(torch.zeros(2, 66), 4, 0, load_balanced=False)


def test_checkpointing_recomputes_the_ring_exactly(results: dict) -> None:
    assert losses(results["cp2_ac_selective"]) == losses(results["cp2"])


class _Attention(torch.nn.Module):
    """Attention computed by hand or by SDPA with a mask/dropout: what CP must refuse, never silently shard."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if self.how == "by_hand":
            return torch.softmax(q @ q.transpose(-1, -2), dim=-1) @ q
        if self.how == "mask":
            return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("by_hand", "M.attention ran without calling F.scaled_dot_product_attention"),
        ("mask", "M.attention passes attn_mask to scaled_dot_product_attention"),
        ("dropout", "M.attention uses attention dropout_p=0.1; context parallel needs 0"),
    ],
)
def test_attention_it_cannot_split_is_refused(how: str, message: str) -> None:
    module = _Attention(how)
    _swap_attention(module, ContextParallelAttention(group=None, style="ring", where="M.attention"))  # refused before any collective
    with pytest.raises(ContextParallelError, match=message):
        module(torch.randn(1, 2, 4, 8))
