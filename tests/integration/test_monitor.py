"""MeshMonitor: the logged throughput, FLOPs, memory, communication and pipeline bubble checked against
hand-computed values, on two ranks (DDP, TP, PP and MoE with expert parallel) through the `lit-mesh` CLI."""

from __future__ import annotations

import pytest

from tests.launch import REPO, cli_runs
from tests.workers.monitor_clock import STEP_SECONDS
from zoo.flops import gpt_flops_per_token
from zoo.gpt import GPT, GPTConfig
from zoo.moe import MoEConfig

S = "--trainer.strategy.init_args."
STEPS, BATCH, SEQ = 3, 8, 64
PEAK = 1e9
WINDOW = 2  # ddp2-window: steps timed between two logging steps
MICRO = 4  # pp2 run: 1F1B (the default schedule) over 4 micro-batches
COMMON = [
    "-c",
    str(REPO / "configs/gpt.yaml"),
    "--trainer.devices=2",
    f"--trainer.max_steps={STEPS}",
    "--trainer.log_every_n_steps=1",
    "--trainer.logger=CSVLogger",
    f"--data.global_batch_size={BATCH}",
    "--seed_everything=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.callbacks+=tests.workers.monitor_clock.SteppingClockMonitor",
]

MOE = ["-c", str(REPO / "configs/moe.yaml"), *COMMON[2:]]  # the same run options on the zoo MoE (tiny preset)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("monitor")
    return cli_runs(
        2,
        out,
        [
            {"name": "ddp2", "args": [*COMMON, f"{S}dp_replicate=2"]},
            {"name": "tp2", "args": [*COMMON, f"{S}tp=2", f"--trainer.callbacks.init_args.peak_flops={PEAK}"]},
            {"name": "pp2", "args": [*COMMON, f"{S}pp=2", f"{S}pp_microbatches={MICRO}"]},
            {"name": "cp2", "args": [*COMMON, f"{S}cp=2"]},
            {"name": "moe-ep2", "args": [*MOE, f"{S}dp=2", f"{S}ep=2"]},
            # a window of 2 timed steps before each logging step (steps 2 and 5 log)
            {
                "name": "ddp2-window",
                "args": [
                    *COMMON,
                    f"{S}dp_replicate=2",
                    f"--trainer.max_steps={2 * WINDOW + 2}",
                    f"--trainer.log_every_n_steps={WINDOW + 1}",
                ],
            },
        ],
    )


def _at_each_step(result: dict, key: str) -> list[float]:
    per_step = result["metrics"][key]
    assert len(per_step) == STEPS, f"{key} logged at steps {sorted(per_step)}"
    return [per_step[s] for s in sorted(per_step)]


@pytest.mark.parametrize("layout", ["ddp2", "tp2", "pp2", "cp2"])
def test_throughput_and_flops_equal_the_hand_computed_values(runs: dict, layout: str) -> None:
    # the global batch, whether dp ranks split it (ddp2), tp/pp ranks share it (tp2, pp2) or cp ranks split every
    # sequence (cp2: the FLOPs per token still count attention over all SEQ positions)
    tokens = BATCH * SEQ
    flops = tokens * gpt_flops_per_token(GPTConfig.from_preset("tiny"), SEQ)
    result = runs[layout]
    assert _at_each_step(result, "monitor/step_time_s") == [STEP_SECONDS] * STEPS
    assert _at_each_step(result, "tokens_per_s") == [pytest.approx(tokens / STEP_SECONDS)] * STEPS
    assert result["progress_bar"]["tokens_per_s"] == pytest.approx(tokens / STEP_SECONDS)  # shown in the bar
    assert "monitor/step_time_s" not in result["progress_bar"]  # the rest stays in the logger
    assert (
        _at_each_step(result, "monitor/tokens_per_s_per_device") == [pytest.approx(tokens / STEP_SECONDS / 2)] * STEPS
    )
    assert (
        _at_each_step(result, "monitor/tflops_per_device") == [pytest.approx(flops / STEP_SECONDS / 2 / 1e12)] * STEPS
    )
    for peak in _at_each_step(result, "monitor/peak_memory_gib"):
        assert 0.05 < peak < 24  # a Python process with torch loaded, within this machine


def test_step_time_is_the_windows_mean_and_bytes_are_counted_on_the_untimed_logging_step(runs: dict) -> None:
    # the window: start of step 0 -> start of step 2 (two clock readings: 0.25 s) over 2 steps; then 3 -> 5
    metrics = runs["ddp2-window"]["metrics"]
    logged = [str(WINDOW), str(2 * WINDOW + 1)]  # JSON keys
    assert sorted(metrics["monitor/step_time_s"], key=int) == logged
    assert [metrics["monitor/step_time_s"][s] for s in logged] == [STEP_SECONDS / WINDOW] * 2
    assert [metrics["tokens_per_s"][s] for s in logged] == [pytest.approx(BATCH * SEQ * WINDOW / STEP_SECONDS)] * 2
    # the logging step's bytes (counted outside the window: the clock refuses a reading inside the counting
    # mode): gradients, the non-finite-loss vote and train_loss, as on every logged step of ddp2
    parameters = sum(p.numel() for p in GPT(GPTConfig.from_preset("tiny")).parameters())
    assert [metrics["monitor/comm_mib/dp_replicate"][s] * 2**20 for s in logged] == [4 * parameters + 4 * 2 + 4] * 2


def test_peak_flops_from_the_exact_device_name() -> None:
    from lit_mesh.monitor.peak_flops import peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756.5e12
    assert peak_bf16_flops("NVIDIA H100 NVL") == 835.5e12
    assert peak_bf16_flops("NVIDIA H200") == 989.4e12
    assert peak_bf16_flops("NVIDIA H200 NVL") == 835.5e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-40GB") == peak_bf16_flops("NVIDIA A100 80GB PCIe") == 312e12
    assert peak_bf16_flops("NVIDIA L40S") == 362.05e12
    assert peak_bf16_flops("NVIDIA B200") == 2250e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") is None


def test_mfu_is_achieved_over_peak_when_the_peak_is_known(runs: dict) -> None:
    assert "monitor/mfu" not in runs["ddp2"]["metrics"]  # CPU: no known peak
    achieved = _at_each_step(runs["tp2"], "monitor/tflops_per_device")
    assert _at_each_step(runs["tp2"], "monitor/mfu") == [pytest.approx(a * 1e12 / PEAK) for a in achieved]


def test_ddp_sends_the_gradients_once_over_dp_replicate(runs: dict) -> None:
    # ring all-reduce over 2 ranks: each rank sends 2 (n-1)/n = 1 x the tensor. Per step: the fp32 gradients,
    # the non-finite-loss vote (one fp32 per rank) and the train_loss sync_dist mean (one fp32). On two ranks
    # every mesh dim reuses the world group, so all three count for dp_replicate.
    parameters = sum(p.numel() for p in GPT(GPTConfig.from_preset("tiny")).parameters())
    for sent in _at_each_step(runs["ddp2"], "monitor/comm_mib/dp_replicate"):
        assert sent * 2**20 == 4 * parameters + 4 * 2 + 4
    assert not any(k.startswith("monitor/comm_mib/tp") for k in runs["ddp2"]["metrics"])


def test_tensor_parallel_traffic_is_counted_on_tp(runs: dict) -> None:
    assert all(sent > 0 for sent in _at_each_step(runs["tp2"], "monitor/comm_mib/tp"))
    assert not any(k.startswith("monitor/comm_mib/dp") for k in runs["tp2"]["metrics"])


def test_pipeline_bubble_is_measured_and_next_to_its_formula(runs: dict) -> None:
    # 1F1B, p = 2 stage ranks, m = 4 micro-batches: (p-1)/(m+p-1) = 1/5
    assert _at_each_step(runs["pp2"], "monitor/pp_bubble_formula") == [pytest.approx(1 / 5)] * STEPS
    for bubble in _at_each_step(runs["pp2"], "monitor/pp_bubble"):
        assert 0 < bubble < 1  # a rank idles at least while the other computes the first forward
    for layout in ("ddp2", "tp2"):  # no pipeline: no bubble, no recorder
        assert not any(k.startswith("monitor/pp_bubble") for k in runs[layout]["metrics"])


def test_moe_balance_is_logged_from_the_routing(runs: dict) -> None:
    c = MoEConfig.from_preset("tiny")
    layers = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    metrics = runs["moe-ep2"]["metrics"]
    per_expert = [_at_each_step(runs["moe-ep2"], f"monitor/moe_tokens_per_expert/{e}") for e in range(c.n_experts)]
    for step in range(STEPS):
        counts = [tokens[step] for tokens in per_expert]
        # every token of the global batch goes to top_k experts in every MoE layer (dropless routing)
        assert sum(counts) == BATCH * SEQ * c.top_k * layers
        # max/mean of the layers' summed load is at most the mean over layers of each layer's max/mean
        imbalance = _at_each_step(runs["moe-ep2"], "monitor/moe_imbalance")[step]
        assert max(counts) / (sum(counts) / c.n_experts) <= imbalance * (1 + 1e-6)  # float32 logging
        assert 1 - 1e-6 <= imbalance <= _at_each_step(runs["moe-ep2"], "monitor/moe_imbalance_max")[step] <= c.n_experts
    # the MoE module logs the same routing its own way: the monitor agrees with it
    for e in range(c.n_experts):
        assert per_expert[e] == _at_each_step(runs["moe-ep2"], f"moe/tokens_expert_{e}")
    assert _at_each_step(runs["moe-ep2"], "monitor/moe_imbalance") == pytest.approx(
        _at_each_step(runs["moe-ep2"], "moe/imbalance")
    )
    assert _at_each_step(runs["moe-ep2"], "monitor/moe_aux_loss") == pytest.approx(
        _at_each_step(runs["moe-ep2"], "train_aux_loss"), rel=1e-5
    )
    assert "monitor/comm_mib/ep" in metrics  # the token all-to-alls go over the ep group
    for layout in ("ddp2", "tp2", "pp2"):  # dense models: no MoE keys
        assert not any(k.startswith("monitor/moe") for k in runs[layout]["metrics"])
