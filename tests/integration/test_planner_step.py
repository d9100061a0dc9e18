"""lit-mesh plan against one real training step of one rank at the target scale (64-1,024 fake ranks, tiny and
small presets; lit_mesh/planner/fake_step.py): the bytes of every collective by mesh dim and operation equal the
planner's byte terms (lit_mesh/planner/traffic.py) within 5%, and the activations the step holds into backward
equal the planner's formula (lit_mesh/planner/memory.py activation_parts) within 10%, per AC mode and micro-batch;
pipelines (1F1B, interleaved) run their schedule's point-to-point for real and are checked for bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.command import main as plan_main
from lit_mesh.planner.fake_step import fake_step
from lit_mesh.planner.memory import Workload, accumulated_grad_bytes, activation_parts
from lit_mesh.planner.pipeline_model import Schedule
from lit_mesh.planner.shapes import gpt_shapes
from lit_mesh.planner.step_process import step_in_process
from lit_mesh.planner.traffic import comm_bytes, merged_like
from zoo.gpt import GPTConfig
from zoo.moe import MoEConfig

TINY, SMALL, MOE = GPTConfig.from_preset("tiny"), GPTConfig.from_preset("small"), MoEConfig.from_preset("tiny")
MOE_64 = MoEConfig.from_preset("tiny", n_experts=64)
WIDE_HEADS = GPTConfig.from_preset("small", head_dim=64)  # 4 heads of 64 on dim 128: wq (256, 128), wo (128, 256)
SEQ = 64

# (name, config, layout, options): every dim on at least one layout, each AC mode, fp32 and bf16-mixed, micro-batches
# of 1 to 4 sequences; 64 to 1,024 ranks. One step per case checks both the bytes and the activations.
STEPS = [
    ("fsdp-64", SMALL, MeshLayout(dp_shard=64), {"micro_batch": 4}),
    ("fsdp-64-selective", SMALL, MeshLayout(dp_shard=64), {"ac": "selective", "micro_batch": 1}),
    ("fsdp-64-full-bf16", SMALL, MeshLayout(dp_shard=64), {"ac": "full", "precision": "bf16-mixed"}),
    ("fsdp-1024-padded-bf16", SMALL, MeshLayout(dp_shard=1024), {"precision": "bf16-mixed"}),  # dim 0 padded
    (
        "zero2-64-selective-bf16",
        SMALL,
        MeshLayout(dp_shard=64),
        {"zero_stage": 2, "ac": "selective", "precision": "bf16-mixed"},
    ),
    ("zero1-64", SMALL, MeshLayout(dp_shard=64), {"zero_stage": 1, "ac": "full"}),
    ("hsdp-128", SMALL, MeshLayout(dp_replicate=8, dp_shard=16), {}),
    ("tp-sp-64", SMALL, MeshLayout(dp_shard=32, tp=2), {"micro_batch": 4}),
    (
        "tp-sp-64-selective-bf16",
        SMALL,
        MeshLayout(dp_shard=32, tp=2),
        {"ac": "selective", "precision": "bf16-mixed", "micro_batch": 4},
    ),
    ("tp-sp-64-wide-heads", WIDE_HEADS, MeshLayout(dp_shard=32, tp=2), {"micro_batch": 1}),
    ("tp-sp-64-wide-heads-selective", WIDE_HEADS, MeshLayout(dp_shard=32, tp=2), {"ac": "selective", "micro_batch": 1}),
    ("tp-sp-64-full", SMALL, MeshLayout(dp_shard=32, tp=2), {"ac": "full", "micro_batch": 1}),
    # full AC on the model's every 2nd block: the others re-gather their inputs in backward
    ("tp-sp-64-full/2", SMALL, MeshLayout(dp_shard=32, tp=2), {"ac": "full/2", "micro_batch": 1}),
    # and selective AC on the blocks between (ac_other_blocks="selective"): no re-gathers, selective's counts
    ("tp-sp-64-full/2+selective", SMALL, MeshLayout(dp_shard=32, tp=2), {"ac": "full/2+selective", "micro_batch": 1}),
    ("ep-64-full/2+selective", MOE, MeshLayout(dp_shard=64, ep=4), {"ac": "full/2+selective"}),
    # the last cp rank: the ring's causal blocks give it the most attention outputs to keep under selective AC
    ("cp-ring-64-selective-last", SMALL, MeshLayout(dp_shard=16, cp=4), {"ac": "selective", "rank": 3}),
    ("cp-ring-64-full", SMALL, MeshLayout(dp_shard=16, cp=4), {"ac": "full"}),
    ("cp-ulysses-64", SMALL, MeshLayout(dp_shard=32, cp=2), {"cp_style": "ulysses"}),
    ("ep-64", MOE, MeshLayout(dp_shard=64, ep=4), {}),
    # selective AC keeps the dispatch's output, not the combine's; AC's recompute stops before the combine (its
    # all-to-all run again would miss the bytes by a quarter: lit_mesh/parallel/expert_combine.py)
    ("ep-64-selective", MOE, MeshLayout(dp_shard=64, ep=4), {"ac": "selective"}),
    ("ep-64-full", MOE, MeshLayout(dp_shard=64, ep=4), {"ac": "full"}),
    ("moe-64-selective", MOE, MeshLayout(dp_shard=64), {"ac": "selective"}),
    # ep_dispatch="by_node": ep 16 over 2 nodes of 8, each token once per node between them ("ep:inter", one rank per
    # node) and its routed copies inside the node ("ep:intra"); selective AC keeps both stages' outputs
    ("ep-by-node-64", MOE_64, MeshLayout(dp_shard=64, ep=16), {"ep_dispatch": "by_node"}),
    ("ep-by-node-64-selective", MOE_64, MeshLayout(dp_shard=64, ep=16), {"ep_dispatch": "by_node", "ac": "selective"}),
    ("ep-by-node-64-full", MOE_64, MeshLayout(dp_shard=64, ep=16), {"ep_dispatch": "by_node", "ac": "full"}),
    # whole experts under tp (expert_tp=1): each tp rank routes its own sequence shard, the experts split over ep (the
    # innermost ranks of dp_shard x tp) and FSDP-sharded over the rest
    ("ep-tp-64-whole-experts", MOE, MeshLayout(dp_shard=32, tp=2, ep=4), {"expert_tp": 1}),
    ("ep-tp-64-whole-experts-selective", MOE, MeshLayout(dp_shard=32, tp=2, ep=4), {"expert_tp": 1, "ac": "selective"}),
    ("ep-tp-64-whole-experts-full", MOE, MeshLayout(dp_shard=32, tp=2, ep=4), {"expert_tp": 1, "ac": "full"}),
    # ep over dp_shard x tp (64 experts over 32 x 2 ranks: ep takes tp ranks too, one expert per rank)
    ("ep-over-tp-64-whole-experts", MOE_64, MeshLayout(dp_shard=32, tp=2, ep=64), {"expert_tp": 1}),
    # HSDP: the experts' shards all-reduced over the replicas; ep = 2 takes exactly the tp pair (one group: "tp=ep").
    # In a process of its own: an earlier fake world's tp mesh of the same shape is still in torch's caches there
    (
        "ep-tp-hsdp-64-whole-experts",
        MOE,
        MeshLayout(dp_replicate=2, dp_shard=16, tp=2, ep=2),
        {"expert_tp": 1, "own_process": True},
    ),
    # pipelines: torch's schedules through lit_mesh's runner, over the schedule's fewest micro-batches, on rank 0
    ("pp-1f1b-64", SMALL, MeshLayout(pp=2, dp_shard=32), {"schedule": Schedule(), "microbatches": 2}),
    (
        "pp-interleaved-cp-64-selective-bf16",
        SMALL,
        MeshLayout(pp=2, dp_shard=16, cp=2),
        {"schedule": Schedule("interleaved_1f1b", 2), "microbatches": 2, "ac": "selective", "precision": "bf16-mixed"},
    ),
    ("hsdp-cp-tp-1024-bf16", SMALL, MeshLayout(dp_replicate=2, dp_shard=128, cp=2, tp=2), {"precision": "bf16-mixed"}),
    # float8 tensorwise: FSDP gathers the linears' weights in float8 after an all-reduce of their amax; without AC
    # the blocks re-gather their sequence-parallel inputs and hold what bf16's hold (torch's TP styles on the float8
    # linears). bf16-true: under autocast torchao's CPU emulation keeps fp32 inputs where a GPU keeps bf16 ones
    (
        "tp-sp-64-float8-bf16-true",
        SMALL,
        MeshLayout(dp_shard=32, tp=2),
        {"precision": "bf16-true", "float8": "tensorwise", "micro_batch": 1},
    ),
]
SEQ_LEN = 256


@pytest.mark.parametrize(("config", "layout", "options"), [c[1:] for c in STEPS], ids=[c[0] for c in STEPS])
def test_a_real_step_moves_and_holds_what_the_planner_estimates(
    config: object, layout: MeshLayout, options: dict
) -> None:
    options = dict(options)
    precision, ac = options.pop("precision", "32-true"), options.pop("ac", "none")
    micro_batch, rank = options.pop("micro_batch", 2), options.pop("rank", 0)
    micro_batches = options.pop("microbatches", 1)
    if options.pop("own_process", False):
        step = dict(zero_stage=3, schedule=Schedule(), microbatches=micro_batches, **options)
        counted = step_in_process(config, layout, micro_batch, SEQ_LEN, rank, precision, ac, **step)
    else:
        counted = fake_step(
            config, layout, micro_batch, SEQ_LEN, rank, precision, ac, microbatches=micro_batches, **options
        )
    work = Workload(micro_batch * layout.dp * micro_batches, SEQ_LEN, micro_batch)
    # expert_tp: comm_bytes reads it from the shapes
    shapes = gpt_shapes(config).with_whole_experts() if options.pop("expert_tp", None) == 1 else gpt_shapes(config)
    if options.pop("ep_dispatch", None) == "by_node":  # the fake step's nodes: 8 ranks each
        shapes = shapes.with_ep_nodes(layout.ep // 8)
    stage = rank // (layout.world_size // layout.pp)
    estimate = merged_like(comm_bytes(shapes, layout, work, precision, ac, stage=stage, **options), counted.bytes)
    assert set(counted.bytes) == set(estimate), (counted.bytes, estimate)
    for dim, ops in counted.bytes.items():
        assert set(ops) == set(estimate[dim]), (dim, ops, estimate[dim])
        for op, n in ops.items():
            assert estimate[dim][op] == pytest.approx(n, rel=0.05), (dim, op, n, estimate[dim][op])
    if layout.pp > 1:  # forwards and backwards interleave in a pipeline: the step measures no held activations
        assert counted.activations is None
        assert counted.calls["pp"]["send"] >= micro_batches, counted.calls  # one message per micro-batch at least
        # torch's stages reduce once after the schedule: every block's unsharded gradient is held until then
        grads = accumulated_grad_bytes(shapes, layout, work, precision, stage, schedule=options["schedule"])
        assert grads == pytest.approx(counted.accumulated_grads, rel=0.01), (counted.accumulated_grads, grads)
        return
    if options.get("float8") and precision.endswith("-mixed"):  # torchao applies CUDA's autocast only: its CPU
        return  # emulation then holds fp32 inputs where a GPU holds bf16 ones
    cp_style = options.get("cp_style", "ring")
    held = activation_parts(shapes, layout, work, precision, ac, 0, fused_norm=False, cp_style=cp_style)["held"]
    assert held == pytest.approx(counted.activations, rel=0.10), (counted.activations, held)  # CPU: composite norms


def test_simulate_prints_counted_and_estimated_bytes_side_by_side(capsys: pytest.CaptureFixture) -> None:
    status = plan_main(
        [
            *("--preset", "tiny", "--devices", "64", "--seq-len", str(SEQ), "--global-batch", "128"),
            *("--precision", "32-true", "--ac", "none", "--pp", "1", "--tp", "2", "--cp", "1", "--dp-replicate", "1"),
            *("--simulate", "--json"),
        ]
    )
    text = capsys.readouterr().out
    step = json.loads(text.strip().splitlines()[-1])["step_check"]
    assert status == 0, text
    assert "one real step of rank 0 over the fake process group" in text and "DIFFERS" not in text, text
    assert {(r["dim"], r["op"]) for r in step["bytes"]} >= {("tp", "all_gather"), ("fsdp", "reduce_scatter")}
    for row in step["bytes"]:
        assert row["estimated"] == pytest.approx(row["counted"], rel=0.05), row
    assert step["activations"]["estimated"] == pytest.approx(step["activations"]["counted"], rel=0.10)


def test_simulate_steps_a_rank_of_every_later_pipeline_stage() -> None:
    """Under pp, --simulate steps rank 0 and, each in a process of its own, one rank of every other stage that can
    be the worst: bytes per dim and the unsharded gradients held through the schedule, beside the estimates. (The
    command runs in a process of its own too: this test process has stepped fake worlds of a tp layout already.)"""
    argv = [
        *("--preset", "tiny", "--devices", "64", "--seq-len", str(SEQ), "--global-batch", "128"),
        *("--precision", "bf16-mixed", "--ac", "none", "--pp", "2", "--tp", "2", "--cp", "1"),
        *("--dp-replicate", "1", "--simulate", "--json"),
    ]
    code = f"from lit_mesh.planner.command import main; raise SystemExit(main({argv!r}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    text = done.stdout
    assert done.returncode == 0 and "DIFFERS" not in text, text + done.stderr[-3000:]
    step = json.loads(text.strip().splitlines()[-1])["step_check"]
    assert [later["rank"] for later in step["later_ranks"]] == [32], step  # pp stage 1's first rank
    for checked in (step, *step["later_ranks"]):
        grads = checked["accumulated_grads"]
        assert grads["counted"] > 0 and grads["estimated"] == pytest.approx(grads["counted"], rel=0.05), checked
        assert {("tp", "all_gather"), ("pp", "send")} <= {(r["dim"], r["op"]) for r in checked["bytes"]}
    assert "one real step of rank 32 (pp stage 1, its own process" in text


# later pipeline stages: the last stage (head, logits gathered over tp, gradients sent back, the norms' fp32
# all-reduce), an interleaved rank holding the last stage, EP's experts kept gathered through the schedule
LATER_STAGES = [
    # and pp rank 0 under interleaved 1F1B with tp: its stages 0 and 2 hold blocks 0 and 2, neither an every-2nd
    # block of the model, so full/2 recomputes nothing there (counted by the rank's own blocks, block 2 would be)
    (
        "pp2-tp2-interleaved-first-full/2",
        "small",
        {"pp": 2, "dp_shard": 16, "tp": 2},
        0,
        "full/2",
        "32-true",
        "interleaved_1f1b",
        2,
        2,
    ),
    (
        "pp2-cp2-interleaved-last-selective",
        "small",
        {"pp": 2, "dp_shard": 16, "cp": 2},
        32,
        "selective",
        "bf16-mixed",
        "interleaved_1f1b",
        2,
        2,
    ),
    ("pp4-tp2-last-full-bf16", "small", {"pp": 4, "dp_shard": 8, "tp": 2}, 48, "full", "bf16-mixed", "1f1b", 1, 4),
    ("moe-pp2-ep4-last", "moe", {"pp": 2, "dp_shard": 32, "ep": 4}, 32, "none", "32-true", "1f1b", 1, 2),
]
# fresh Python processes: after one fake world with tp, torch's sharding cache can hand a later world's DTensors the
# earlier world's mesh and process groups (the same tp ranks, or the same submesh shape)
_LATER_STAGE_STEPS = """
import json, sys
from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.fake_step import fake_step
from lit_mesh.planner.pipeline_model import Schedule
from zoo.gpt import GPTConfig
from zoo.moe import MoEConfig
for _, preset, layout, rank, ac, precision, schedule, v, micro in json.loads(sys.argv[1]):
    config = MoEConfig.from_preset("tiny") if preset == "moe" else GPTConfig.from_preset(preset)
    counts = fake_step(config, MeshLayout(**layout), 1, 256, rank, precision, ac, schedule=Schedule(schedule, v),
                       microbatches=micro)
    print(json.dumps({"bytes": counts.bytes, "accumulated_grads": counts.accumulated_grads}))
"""


def test_ranks_of_later_pipeline_stages_move_what_the_planner_estimates() -> None:
    # two processes at once: the tp pipeline of pp rank 0 alone, the other layouts together (as ever before)
    groups = [LATER_STAGES[:1], LATER_STAGES[1:]]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the other xdist worker on 2 cores
    steps = [
        subprocess.Popen(
            [sys.executable, "-c", _LATER_STAGE_STEPS, json.dumps(group)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
        )
        for group in groups
    ]
    lines = []
    for group, step in zip(groups, steps):
        try:
            stdout, stderr = step.communicate(timeout=300)
        finally:
            step.kill()
        assert step.returncode == 0, ([case[0] for case in group], stderr[-3000:])
        lines += [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(LATER_STAGES), lines
    for case, line in zip(LATER_STAGES, lines):
        name, preset, dims, rank, ac, precision, schedule_name, v, micro = case
        step = json.loads(line)
        counted = step["bytes"]
        layout, schedule = MeshLayout(**dims), Schedule(schedule_name, v)
        config = MOE if preset == "moe" else GPTConfig.from_preset(preset)
        stage = rank // (layout.world_size // layout.pp)
        work = Workload(layout.dp * micro, 256, 1)
        estimate = comm_bytes(gpt_shapes(config), layout, work, precision, ac, stage=stage, schedule=schedule)
        assert {(d, op) for d in counted for op in counted[d]} == {(d, op) for d in estimate for op in estimate[d]}, (
            name
        )
        for dim, ops in counted.items():
            for op, n in ops.items():
                assert estimate[dim][op] == pytest.approx(n, rel=0.05), (name, dim, op, n, estimate[dim][op])
        grads = accumulated_grad_bytes(gpt_shapes(config), layout, work, precision, stage, schedule=schedule)
        assert grads == pytest.approx(step["accumulated_grads"], rel=0.01), (name, step["accumulated_grads"], grads)
