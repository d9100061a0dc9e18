"""The rules table (lit_mesh/rules.py), enumerated: every rule has one input that breaks it (its error or warning,
with its message) and one that passes. A rule added without a case here fails test_every_rule_has_a_case."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest

from lit_mesh.comm.options import CompressionOptions
from lit_mesh.mesh import MeshLayout
from lit_mesh.options import (
    CheckpointOptions,
    CommunicationOptions,
    CompileOptions,
    DataParallelOptions,
    MemoryOptions,
    MeshOptions,
)
from lit_mesh.parallel.pipeline import PipelineSettings
from lit_mesh.rules import RULES, RULES_BY_NAME, Facts, enforce
from lit_mesh.topology import Topology

O = MeshOptions()
DEGREES = dict(dp=None, dp_replicate=None, dp_shard=None, tp=1, cp=1, pp=1, ep=1)
FP16 = CommunicationOptions(compression=CompressionOptions(mode="fp16"))


def init(options: MeshOptions = O, **degrees: object) -> Facts:
    return Facts(degrees={**DEGREES, **degrees}, options=options)


def launch(layout: MeshLayout, options: MeshOptions = O, precision: str = "32-true", nodes: int = 1) -> Facts:
    topology = Topology(nodes=nodes, devices_per_node=layout.world_size // nodes)
    return Facts(options=options, layout=layout, precision=precision, topology=topology)


def setup(layout: MeshLayout, owners: list, options: MeshOptions = O, self_parallelised: bool = False) -> Facts:
    return Facts(options=options, layout=layout, model_name="Net", owners=owners, self_parallelised=self_parallelised)


def owner(moe_layer: str = "") -> SimpleNamespace:
    moe = SimpleNamespace(layer=moe_layer) if moe_layer else None  # a MoEPlan, or None for a dense model
    return SimpleNamespace(name="model", module=SimpleNamespace(), plan=SimpleNamespace(moe=moe))


def pipeline(pp: int, **settings: object) -> Facts:
    return init(replace(O, pipeline=PipelineSettings(**settings)), pp=pp)


PP2, CP2, TP2 = MeshLayout(pp=2, dp_shard=2), MeshLayout(dp_shard=2, cp=2), MeshLayout(dp_shard=2, tp=2)
DP4 = MeshLayout(dp_shard=4)
AC = replace(O, memory=MemoryOptions("full"))
ZERO1, ZERO2 = replace(O, data=DataParallelOptions(1)), replace(O, data=DataParallelOptions(2))

# rule -> (facts that break it, the message or a part of it, facts that pass)
CASES: dict[str, tuple[Facts, str, Facts]] = {
    "one_auto_degree": (init(dp="auto", dp_shard="auto"), "dp='auto' and dp_shard='auto': only one degree may be 'auto'",
                        init(dp="auto")),
    "one_stage_schedule": (pipeline(2, schedule="gpipe", stages_per_rank=2), "pp_schedule='gpipe' runs one stage per rank,"
                           " not pp_stages_per_rank=2", pipeline(2, schedule="gpipe", stages_per_rank=1)),
    "interleaved_schedule_stages": (pipeline(2, schedule="interleaved_1f1b", stages_per_rank=1),
                                    "set pp_stages_per_rank >= 2", pipeline(2, schedule="interleaved_1f1b")),
    "v_schedule_two_stages": (pipeline(2, schedule="zbv", stages_per_rank=3), "runs exactly 2 stages per rank (V shape),"
                              " not 3; set pp_stages_per_rank=2", pipeline(2, schedule="zbv", stages_per_rank=2)),
    "pp_split_per_stage": (pipeline(2, split=(1, 1, 2)), "pp_split=[1, 1, 2] has 3 entries but pp=2 x stages per rank 1"
                           " = 2 stages", pipeline(2, split=(1, 3))),
    "pipeline_options_need_pp": (pipeline(1, schedule="gpipe"), "pp_schedule, pp_microbatches, pp_stages_per_rank and"
                                 " pp_split need pp > 1", pipeline(2, schedule="gpipe")),
    "pp_with_cp": (init(pp=2, cp=2), "pp=2 with cp=2: pipeline and context parallel together are not supported yet",
                   init(pp=2)),
    "zero_stage_with_pp": (init(ZERO2, pp=2), "zero_stage=2 with pp=2: under a pipeline each stage's parameters are"
                           " already gathered once per step", init(ZERO2)),
    "compile_with_tp": (init(replace(O, compile=CompileOptions("aot_eager")), tp=2), "compile_blocks=True with tp=2:"
                        " compiled blocks do not yet give correct gradients", init(replace(O, compile=CompileOptions("aot_eager")))),
    "async_save_needs_sharded": (init(replace(O, checkpoint=CheckpointOptions(False, True))), "async_save=True writes"
                                 " sharded checkpoints: keep save_distributed_checkpoint=True",
                                 init(replace(O, checkpoint=CheckpointOptions(True, True)))),
    "compression_state_needs_sharded": (init(replace(O, communication=FP16, checkpoint=CheckpointOptions(False))),
                                        "single-file checkpoints do not hold its per-rank state", init(replace(O, communication=FP16))),
    "model_parallel_divides_world": (Facts(degrees={**DEGREES, "tp": 3}, world_size=4), "pp=1 x cp=1 x tp=3 = 3 does not"
                                     " divide the world size 4 (devices x num_nodes); choose degrees whose product divides 4,"
                                     " e.g. tp in [1, 2, 4]", Facts(degrees={**DEGREES, "tp": 2}, world_size=4)),
    "ep_divides_dp_shard_cp": (Facts(layout=MeshLayout(dp_shard=2, cp=2, ep=3)), "ep=3 does not divide dp_shard x cp = 2 x 2"
                               " = 4 (expert parallel borrows its ranks from them, it does not add any); choose ep in [1, 2, 4]",
                               Facts(layout=MeshLayout(dp_shard=2, cp=2, ep=4))),
    "pp_with_fp16_scaler": (launch(PP2, precision="16-mixed"), "pp=2 with fp16 loss scaling: the pipeline schedule runs"
                            " the backward itself", launch(PP2, precision="bf16-mixed")),
    "compression_needs_data_parallel": (launch(MeshLayout(tp=2), replace(O, communication=FP16)), "grad_compression='fp16'"
                                        " but the mesh has no data-parallel dim", launch(DP4, replace(O, communication=FP16))),
    "zero_stage_needs_sharded_dp": (launch(MeshLayout(dp_replicate=2), ZERO1), "zero_stage=1 shards optimizer state"
                                    " over the sharded data-parallel dim, but the mesh has none (pp=1 x dp_replicate=2",
                                    launch(MeshLayout(dp_replicate=2, dp_shard=2), ZERO1)),
    "topology_holds_mesh": (replace(launch(DP4), topology=Topology(nodes=1, devices_per_node=2)), "the mesh has 4 ranks",
                            launch(DP4)),
    "tp_inside_node_strict": (launch(MeshLayout(tp=4), replace(O, communication=CommunicationOptions(strict_topology=True)), nodes=2),
                              "tp=4 does not divide the 2 devices of one node: tensor-parallel groups cross nodes (their"
                              " all-reduces per layer then run at 50 GB/s instead of 450 GB/s); choose tp dividing 2 (or"
                              " strict_topology=False to run anyway)", launch(MeshLayout(tp=4), nodes=2)),
    "tp_inside_node": (launch(MeshLayout(tp=4), nodes=2), "tp=4 does not divide the 2 devices of one node",
                       launch(MeshLayout(dp_replicate=2, tp=2), nodes=2)),
    "cp_tp_inside_node": (launch(MeshLayout(cp=2, tp=2), nodes=2), "cp=2 x tp=2 = 4 does not divide the 2 devices of one"
                          " node: context-parallel groups cross nodes", launch(MeshLayout(dp_replicate=2, tp=2), nodes=2)),
    "self_parallelised_without_pp": (setup(PP2, [], self_parallelised=True), "pp=2: configure_model parallelised the"
                                     " model itself", setup(DP4, [], self_parallelised=True)),
    "self_parallelised_without_compression": (setup(DP4, [], replace(O, communication=FP16), self_parallelised=True),
                                              "grad_compression hooks into the data parallelism MeshStrategy applies",
                                              setup(DP4, [owner()], replace(O, communication=FP16))),
    "self_parallelised_without_zero_stage": (setup(DP4, [], ZERO2, self_parallelised=True), "zero_stage=2 chooses"
                                             " how MeshStrategy applies FSDP2", setup(DP4, [owner()], ZERO2)),
    "self_parallelised_without_cp": (setup(CP2, [], self_parallelised=True), "cp=2 but configure_model of Net"
                                     " parallelised the model itself", setup(CP2, [owner()])),
    "pp_needs_one_plan": (setup(PP2, [owner(), owner()]), "pp > 1 pipelines one model that declares parallel_plan();"
                          " Net has ['model', 'model']", setup(PP2, [owner()])),
    "pp_without_moe": (setup(PP2, [owner("moe")]), "pp=2 with the MoE model SimpleNamespace: pipeline stages do not"
                       " carry the auxiliary load-balancing loss", setup(DP4, [owner("moe")])),
    "block_options_need_plan": (setup(DP4, [], AC), "activation_checkpointing acts on the blocks a parallel_plan()"
                                " names, but no module of Net declares one", setup(DP4, [owner()], AC)),
    "tp_needs_plan": (setup(TP2, []), "tp=2 but no module of Net declares parallel_plan()", setup(TP2, [owner()])),
    "cp_needs_plan": (setup(CP2, []), "cp=2 but no module of Net declares parallel_plan() with its attention",
                      setup(CP2, [owner()])),
}


def test_every_rule_has_a_case() -> None:
    assert [rule.name for rule in RULES] == list(CASES)  # same rules, table order
    assert len(RULES_BY_NAME) == len(RULES)  # names are unique


@pytest.mark.parametrize("name", list(CASES))
def test_rule(name: str) -> None:
    rule = RULES_BY_NAME[name]
    broken, message, passing = CASES[name]
    assert not rule.broken(passing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enforce(rule, passing)
    assert rule.broken(broken)
    assert message in rule.message(broken)
    if rule.warn_only:
        with pytest.warns(UserWarning, match=re.escape(message)):
            enforce(rule, broken)
    else:
        with pytest.raises(rule.error, match=re.escape(message)):
            enforce(rule, broken)
