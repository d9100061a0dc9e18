"""MeshOptions: MeshStrategy's arguments, checked and grouped by concern, frozen.

MeshStrategy.__init__ keeps flat, type-annotated arguments (LightningCLI reads them) and hands them to
`build_options`, which checks each value beside the option it belongs to, then the "init" rules of
lit_mesh/rules.py. Everything downstream (parallelize, the components) reads the groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lit_mesh.comm.hierarchical import AllReduceMode, check_allreduce_mode
from lit_mesh.comm.options import CompressionOptions, GradCompression, resolve_compression
from lit_mesh.mesh import Degree, check_degrees
from lit_mesh.parallel.checkpointing import check_activation_checkpointing
from lit_mesh.parallel.compile import check_compile_backend
from lit_mesh.parallel.context import ContextOptions, check_cp_style
from lit_mesh.parallel.data import ZeroStage, check_zero_stage
from lit_mesh.parallel.pipeline import PipelineSettings, check_pipeline_settings
from lit_mesh.parallel.grid import check_tp_mode
from lit_mesh.replan import OnWorldChange, check_on_world_change
from lit_mesh.rules import Facts, check
from lit_mesh.topology import Topology, as_topology


@dataclass(frozen=True)
class MeshDegrees:
    """The mesh: degrees as given (resolved against the world size by lit_mesh.mesh.resolve_layout)."""

    dp: Degree = None
    dp_replicate: Optional[int] = None
    dp_shard: Degree = None
    tp: Degree = 1  # "auto": the devices of a node
    cp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = True  # shard activations over the sequence between TP regions

    def degrees(self) -> dict[str, Any]:
        return dict(dp=self.dp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, cp=self.cp,
                    pp=self.pp, ep=self.ep)  # fmt: skip


@dataclass(frozen=True)
class TensorOptions:
    mode: str = "1d"  # "1d" (Megatron-style), "2d", "2.5d", "3d": lit_mesh/parallel/grid/
    depth: Optional[int] = None  # 2.5-D only: the grid's depth d (tp = d * q * q)


@dataclass(frozen=True)
class DataParallelOptions:
    zero_stage: ZeroStage = 3  # what the sharded data-parallel dim shards: 3 FSDP; 2, 1 (lit_mesh/parallel/data.py)


@dataclass(frozen=True)
class MemoryOptions:
    activation_checkpointing: str = "none"  # "none", "full" or "selective"
    ac_every_n_blocks: int = 1


@dataclass(frozen=True)
class CompileOptions:
    backend: Optional[str] = None  # None: blocks are not compiled
    async_tp: bool = False  # torch's micro-pipeline TP in the compiled blocks (CUDA + NCCL, inductor, SP)


@dataclass(frozen=True)
class CommunicationOptions:
    compression: Optional[CompressionOptions] = None  # None: exact gradient reductions
    allreduce: AllReduceMode = "auto"
    topology: Optional[Topology] = None  # as given; the run's is read from the cluster environment at launch
    strict_topology: bool = False


@dataclass(frozen=True)
class CheckpointOptions:
    distributed: bool = True  # sharded directories (one file per rank), else one full file
    asynchronous: bool = False  # written in a background thread


@dataclass(frozen=True)
class MeshOptions:
    """Everything the user chose, by concern."""

    mesh: MeshDegrees = MeshDegrees()
    tensor: TensorOptions = TensorOptions()
    data: DataParallelOptions = DataParallelOptions()
    pipeline: PipelineSettings = PipelineSettings()
    context: ContextOptions = ContextOptions()
    memory: MemoryOptions = MemoryOptions()
    compile: CompileOptions = CompileOptions()
    communication: CommunicationOptions = CommunicationOptions()
    checkpoint: CheckpointOptions = CheckpointOptions()
    stop_on_nonfinite_loss: bool = True
    on_world_change: OnWorldChange = "error"  # lit_mesh/replan.py


def build_options(
    *,
    dp: Degree,
    dp_replicate: Optional[int],
    dp_shard: Degree,
    tp: Degree,
    cp: int,
    cp_style: str,
    pp: int,
    ep: int,
    pp_schedule: str,
    pp_microbatches: Optional[int],
    pp_stages_per_rank: Optional[int],
    pp_split: Optional[Sequence[int]],
    sequence_parallel: Optional[bool],
    activation_checkpointing: str,
    ac_every_n_blocks: int,
    compile_blocks: bool,
    compile_backend: str,
    async_tp: bool,
    stop_on_nonfinite_loss: bool,
    save_distributed_checkpoint: bool,
    async_save: bool,
    grad_compression: GradCompression,
    topology: Any,
    strict_topology: bool,
    allreduce: str,
    on_world_change: str = "error",
    zero_stage: ZeroStage = 3,
    tp_mode: str = "1d",
    tp_depth: Optional[int] = None,
) -> MeshOptions:
    """MeshStrategy's flat arguments -> MeshOptions; raises what needs no world size, in the user's process."""
    check_tp_mode(tp_mode, tp_depth)
    if sequence_parallel is None:  # SP splits 1-D TP's sequence; the grid schemes split the batch instead
        sequence_parallel = tp_mode == "1d"
    mesh = MeshDegrees(dp, dp_replicate, dp_shard, tp, cp, pp, ep, sequence_parallel)
    check_degrees(**mesh.degrees())
    check_zero_stage(zero_stage)
    pipeline = check_pipeline_settings(pp_schedule, pp_microbatches, pp_stages_per_rank, pp_split)
    check_activation_checkpointing(activation_checkpointing, ac_every_n_blocks)
    check_cp_style(cp_style)
    if compile_blocks:
        check_compile_backend(compile_backend)
    check_allreduce_mode(allreduce)
    check_on_world_change(on_world_change)
    options = MeshOptions(
        mesh=mesh,
        tensor=TensorOptions(tp_mode, tp_depth),
        data=DataParallelOptions(zero_stage),
        pipeline=pipeline,
        context=ContextOptions(cp_style),
        memory=MemoryOptions(activation_checkpointing, ac_every_n_blocks),
        compile=CompileOptions(compile_backend if compile_blocks else None, async_tp),
        communication=CommunicationOptions(resolve_compression(grad_compression), allreduce, as_topology(topology), strict_topology),  # fmt: skip
        checkpoint=CheckpointOptions(save_distributed_checkpoint, async_save),
        stop_on_nonfinite_loss=stop_on_nonfinite_loss,
        on_world_change=on_world_change,  # type: ignore[arg-type]
    )
    check("init", Facts(degrees=mesh.degrees(), options=options))
    return options
