"""MeshStrategy: the Lightning lifecycle, adapted to one N-D mesh.

MeshStrategy: the Lightning lifecycle, adapted to one N-D mesh. Each hook is "Lightning asks -> a component
answers": lit_mesh.options (arguments), lit_mesh.rules (what may combine), lit_mesh.mesh (degrees, DeviceMesh),
lit_mesh.parallel.apply (plans), lit_mesh.parallel.pipeline (the pipeline's runner and step scope),
lit_mesh.comm.reductions (collectives over the right groups), lit_mesh.checkpoint.writer (atomic and async saves),
lit_mesh.training.precision (clipping by the global norm).

Built on Lightning's ModelParallelStrategy (process group, distributed checkpoints, optimizer state) and
extends it from 2D to the N-D mesh, with plans applied for the user.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

import lit_mesh.hf  # noqa: F401  registers the transformers plans and initialisation (plan sources)
from lit_mesh.checkpoint import dcp_writable, optimizer_state_options, refuse_overwriting_other_files, remove_checkpoint
from lit_mesh.checkpoint.pretrained import declared_sources, load_pretrained
from lit_mesh.checkpoint.writer import CheckpointWriter
from lit_mesh.comm.compression import CompressionRun
from lit_mesh.comm.hierarchical import AllReduceMode
from lit_mesh.comm.options import CompressionOptions
from lit_mesh.comm.reductions import Reductions
from lit_mesh.comm.topology import Topology, topology_from_environment
from lit_mesh.init import materialize
from lit_mesh.mesh import (
    MeshAxis,
    MeshLayout,
    MeshViews,
    build_device_mesh,
    lightning_sizes,
    per_node_degrees,
)
from lit_mesh.meta_writes import record_meta_writes
from lit_mesh.options import ARGUMENTS, args_docstring, build_options
from lit_mesh.parallel.activation_checkpointing import ActivationCheckpointing, OtherBlocksCheckpointing
from lit_mesh.parallel.apply import already_parallelized, parallelize
from lit_mesh.parallel.context import CPStyle, gather_batch, shard_batch
from lit_mesh.parallel.data import ZeroStage, defer_gradient_reduction, refuse_fsdp1
from lit_mesh.parallel.expert import folds_experts, moe_load_group
from lit_mesh.parallel.expert_by_node import EPDispatch
from lit_mesh.parallel.float8 import Float8Recipe
from lit_mesh.parallel.fsdp_arguments import offload_policy
from lit_mesh.parallel.grid import TPMode
from lit_mesh.parallel.pipeline.api import pipeline_scope, start_pipeline
from lit_mesh.parallel.pipeline.moe import carry_moe_statistics
from lit_mesh.parallel.pipeline.runner import PipelineRunner
from lit_mesh.parallel.pipeline.tied import TiedParameters
from lit_mesh.parallel.units import manual_wrap_context
from lit_mesh.reliability.elastic import init_process_group_for_attempt
from lit_mesh.reliability.hangs import HangWatch, start_hang_watch, use_watchdog_defaults
from lit_mesh.reliability.nonfinite import NonFiniteLossGuard
from lit_mesh.reliability.replan import (
    SPLITS_KEY,
    OnWorldChange,
    WorldPlan,
    keep_global_batch,
    plan_for_world,
    rescale_batch_progress,
)
from lit_mesh.rules import Facts, check
from lit_mesh.training.log_steps import is_logging_step
from lit_mesh.training.precision import check_precision_plugin, with_global_norm_clipping
from lit_mesh.training.progress import count_steps_in_progress_bar


def _on_device(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of `model` is on `device` (an index-less device matches any index)."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(t.device.type == device.type and device.index in (None, t.device.index) for t in tensors)


def _reshard(model: Optional[torch.nn.Module]) -> None:
    """Free every FSDP unit's gathered parameters (left after validate, test or predict: no backward frees them)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules() if isinstance(model, torch.nn.Module) else ():
        if isinstance(module, FSDPModule):
            module.reshard()


class MeshStrategy(ModelParallelStrategy):
    """Train on one N-D DeviceMesh (pp, dp_replicate, dp_shard, cp, tp) with the model's parallel plan applied.

    The arguments (their help: the "Args" section below) are defined once, in the options dataclass of the unit that
    owns each (lit_mesh/options.py collects them); this signature repeats their names, types and defaults for IDEs
    and LightningCLI, and tests/unit/test_options.py checks that it matches.
    """

    strategy_name = "mesh"

    def __init__(
        self,
        dp: Union[int, Literal["auto"], None] = None,
        dp_replicate: Optional[int] = None,
        dp_shard: Union[int, Literal["auto"], None] = None,
        tp: Union[int, Literal["auto"]] = 1,
        cp: int = 1,
        cp_style: CPStyle = "ring",
        pp: int = 1,
        ep: int = 1,
        pp_schedule: str = "1f1b",
        pp_microbatches: Optional[int] = None,
        pp_stages_per_rank: Optional[int] = None,
        pp_split: Optional[list[int]] = None,
        tp_mode: TPMode = "1d",
        tp_depth: Optional[int] = None,
        sequence_parallel: Optional[bool] = None,
        expert_tp: Optional[int] = None,
        ep_dispatch: EPDispatch = "all_to_all",
        activation_checkpointing: ActivationCheckpointing = "none",
        ac_every_n_blocks: int = 1,
        ac_other_blocks: OtherBlocksCheckpointing = "none",
        compile_blocks: bool = False,
        compile_backend: str = "inductor",
        async_tp: bool = False,
        float8: Optional[Float8Recipe] = None,
        stop_on_nonfinite_loss: bool = True,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        grad_compression: Union[str, CompressionOptions, None] = None,
        topology: Optional[Topology] = None,
        strict_topology: bool = False,
        allreduce: AllReduceMode = "flat",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        data_parallel_size: Union[int, Literal["auto"], None] = None,
        tensor_parallel_size: Union[int, Literal["auto"], None] = None,
        on_world_change: OnWorldChange = "error",
        zero_stage: ZeroStage = 3,
        auto_wrap_policy: Optional[Any] = None,
        activation_checkpointing_policy: Optional[Any] = None,
        sharding_strategy: Optional[str] = None,
        state_dict_type: Optional[Literal["full", "sharded"]] = None,
        cpu_offload: Optional[Any] = None,
        mixed_precision: Optional[Any] = None,
        device_mesh: Optional[tuple[int, int]] = None,
        **kwargs: Any,  # FSDPStrategy's FSDP1 keyword arguments (lit_mesh/parallel/fsdp_arguments.py)
    ) -> None:
        given = {name: value for name, value in locals().items() if name in ARGUMENTS}
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # what needs no world size fails here, in the user's process
        self.options = build_options(**given, **kwargs)
        self._save_distributed_checkpoint = self.options.checkpoint.distributed  # state_dict_type may have set it
        self._lightning_sizes = lightning_sizes(data_parallel_size, tensor_parallel_size)
        self._nonfinite = NonFiniteLossGuard() if stop_on_nonfinite_loss else None
        self._world_plan: Optional[WorldPlan] = None
        self._base_accumulation: Optional[int] = None  # the Trainer's accumulate_grad_batches before a replan
        self.mesh_views: Optional[MeshViews] = None
        self.topology: Optional[Topology] = self.options.communication.topology  # the run's, from launch on
        self.reductions: Optional[Reductions] = None  # made once the processes exist
        self.compression_run: Optional[CompressionRun] = None  # the run's compression state, made in setup()
        self._pipeline: Optional[PipelineRunner] = None
        self._checkpoints = CheckpointWriter(asynchronous=async_save)
        self._hang_watch: Optional[HangWatch] = None

    # ---- degrees and mesh -------------------------------------------------------------------------------

    @property
    def layout(self) -> MeshLayout:
        """The resolved degrees (known once the Trainer has set devices and num_nodes)."""
        if self._world_plan is None:
            degrees = per_node_degrees(
                self.options.mesh.degrees(), self._lightning_sizes, self.num_nodes, self.num_processes
            )
            degrees.update(self.options.fsdp.degrees(self.num_nodes, self.num_processes))  # FSDPStrategy's names
            self._world_plan = plan_for_world(
                self.num_processes * self.num_nodes, degrees, self.options.world.on_world_change
            )
        return self._world_plan.layout

    @property
    def _views(self) -> MeshViews:
        """The mesh's named views, once setup_environment has built them."""
        assert self.mesh_views is not None, "the mesh is built in setup_environment"
        return self.mesh_views

    @property
    def global_batch_splits(self) -> int:
        """Micro-batches per global batch: 1, or more after on_world_change="replan" (zoo's data modules read it)."""
        return self._world_plan.splits if self._world_plan is not None else 1

    @property
    def is_distributed(self) -> bool:  # read by the Trainer for strategies outside its own list (not a base method)
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every tp (and cp, pp) rank of one replica reads the same batch
        if self.mesh_views is None:
            raise RuntimeError("MeshStrategy.distributed_sampler_kwargs exists once the processes have started")
        dp_mesh = self.mesh_views.dp
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @override
    def _configure_launcher(self) -> None:
        # Called by the Trainer before any process is spawned: validate here, not after spawning. The precision
        # first (its rules need no world size), then every "launch" rule once the layout and topology are known.
        check_precision_plugin(self.precision_plugin)
        layout = self.layout  # the degrees against the world size
        assert self.cluster_environment is not None
        self.topology = topology_from_environment(
            self.cluster_environment, self.num_nodes, self.num_processes, self.options.communication.topology
        )
        precision = str(self.precision_plugin.precision)
        check(
            "launch",
            Facts(
                options=self.options,
                layout=layout,
                precision=precision,
                topology=self.topology,
                precision_plugin=self.precision_plugin,
                device_type=self.root_device.type,
                process_group_backend=self._get_process_group_backend(),
            ),
        )
        # Always configure the launcher: with processes created externally (SLURM, torchrun) it spawns
        # nothing but still validates the cluster settings.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def _setup_distributed(self) -> None:
        # NCCL's watchdog settings, before the group starts; flight-recorder dumps under the run's directory
        root = getattr(getattr(self.lightning_module, "_trainer", None), "default_root_dir", None)
        run_directory = Path(root) if isinstance(root, (str, os.PathLike)) else Path.cwd()
        use_watchdog_defaults(self._get_process_group_backend(), run_directory)
        # torchrun --max-restarts: each attempt on its own rendezvous keys (lit_mesh/reliability/elastic.py says why)
        assert self.cluster_environment is not None  # set by the Trainer's accelerator connector
        excepthook = sys.excepthook
        init_process_group_for_attempt(
            self.cluster_environment, self._get_process_group_backend(), self._timeout, self.root_device
        )
        super()._setup_distributed()
        if self.world_size == 1:  # torch's hook prefixes each traceback line with "[rank0]:": one process, no ranks
            sys.excepthook = excepthook

    @override
    def setup_environment(self) -> None:
        # Lightning's _setup_distributed runs accelerator.setup_device(root_device) (torch.cuda.set_device(local
        # rank)) and then init_process_group(device_id=root_device): each rank's NCCL communicators sit on its own
        # GPU before the mesh is built (tests/unit/test_device_setup.py guards the order)
        self._setup_distributed()
        self.mesh_views = build_device_mesh(self.layout, self.root_device.type, self._timeout)
        self._device_mesh = self.mesh_views.root
        if self.topology is None:  # _configure_launcher did not run (a Strategy used outside the Trainer)
            self.topology = Topology(nodes=self.num_nodes, devices_per_node=self.num_processes)
        self.reductions = Reductions.build(self.mesh_views, self.topology, self.options.communication.allreduce)
        self._hang_watch = start_hang_watch(
            self.mesh_views, self._timeout
        )  # a hung collective is named (lit_mesh/reliability/hangs.py)
        reductions = [
            f"{h.axis} all-reduce {h.mode}: {h.nodes} nodes x {h.per_node} ranks per node"
            for h in self.reductions.hierarchies()
        ]
        rank_zero_info(self.topology.startup_report(self.layout, reductions))  # the layout, once, as one block
        if self._world_plan is not None and self._world_plan.splits > 1:
            rank_zero_info(self._world_plan.report())
        self._checkpoints.connect(self.global_rank, self.world_size, self.barrier, self._timeout)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # as ModelParallelStrategy: trainer.init_module() keeps real weights unless empty_init=True
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model builds on the meta device (setup() shards, then materialises); values written into
        # meta weights there are carried through materialisation, or refused (lit_mesh/meta_writes.py)
        assert self.lightning_module is not None
        # torch.distributed.fsdp.wrap.wrap(module) in configure_model marks an FSDP unit, as under FSDPStrategy
        with record_meta_writes(self.lightning_module), manual_wrap_context():
            yield

    # ---- applying the plans -------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        count_steps_in_progress_bar(trainer)
        refuse_fsdp1(self.model, type(self).__name__)
        assert self.mesh_views is not None and self.reductions is not None
        self.model = self.precision_plugin.convert_module(self.model)  # bf16-true: cast while still on meta
        compression = self.options.communication.compression
        if compression is not None and self.compression_run is None:
            self.compression_run = CompressionRun(compression, self.root_device)
        first_setup = not already_parallelized(self.model)  # validate/test after fit keep the trained weights
        done = parallelize(
            self.model,
            self.mesh_views,
            self.options,
            precision=str(self.precision_plugin.precision),
            compression=self.compression_run,
            replicate_hierarchy=self.reductions.replicate,
            topology=self.topology,
        )
        if first_setup:
            pretrained = declared_sources(self.model)  # filled from pretrained weights: allocated, not initialised
            materialize(self.model, done.owners, self._parameter_device, filled=pretrained)
            load_pretrained(self.model, pretrained)  # each rank reads its slices of the declared pretrained weights
        # cpu_offload: FSDP2 keeps the sharded parameters on the host. A later loop (test after fit) finds them in
        # place: moving them again makes FSDP2 swap every parameter, which fails while the optimizer holds them
        if not self._offloaded and (first_setup or not _on_device(self.model, self.root_device)):
            self.model_to_device()
        if done.stages is not None and self._pipeline is None:
            assert done.stage_ranks is not None  # made with the stages
            pp_group = self.mesh_views[MeshAxis.PP].get_group()
            owner, calls = done.owners[0].module, done.owners[0].plan.pp.calls
            self._pipeline = start_pipeline(
                owner, done.stages, done.stage_ranks, self.options.pipeline, pp_group, self.root_device, calls is None
            )
            if calls is not None:  # the user's own call of the model runs the pipeline (a transformers model)
                calls(owner)
            fold = folds_experts(self.mesh_views.layout, self.options.expert)
            carry_moe_statistics(self._pipeline, done.owners[0], moe_load_group(self.mesh_views, fold))
            if done.tied:  # tied embeddings: the first and the last stage's copies stay one matrix
                tied = TiedParameters(owner, done.tied, done.owners[0].plan, done.stage_ranks, self.mesh_views.root)
                self._pipeline.share_tied(tied)
        self.precision_plugin = with_global_norm_clipping(self.precision_plugin)
        stage_group = self._pipeline.clip_group if self._pipeline is not None else None
        self.precision_plugin.stage_group = stage_group  # type: ignore[attr-defined]  # GlobalNormClipping's attribute
        self.precision_plugin.pipeline = self._pipeline  # type: ignore[attr-defined]  # likewise
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self._base_accumulation = self._base_accumulation or trainer.accumulate_grad_batches
            keep_global_batch(trainer, self.global_batch_splits, self._base_accumulation)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self._offloaded:  # offloaded: the step runs on the host
            _optimizers_to_device(self.optimizers, self.root_device)

    @property
    def _offloaded(self) -> bool:
        """cpu_offload (FSDPStrategy's name): parameters, gradients and optimizer state stay on the host."""
        return offload_policy(self.options.fsdp.cpu_offload) is not None

    @property
    def _parameter_device(self) -> torch.device:
        return torch.device("cpu") if self._offloaded else self.root_device

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.layout.cp > 1:  # every loop (fit, validate, test, predict): each cp rank keeps its part of the sequence
            batch = shard_batch(batch, self._views[MeshAxis.CP], self.options.context.style)
        return batch

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with pipeline_scope(self._pipeline):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with pipeline_scope(self._pipeline):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with pipeline_scope(self._pipeline):  # loss_of / output_of reach the pipeline inside the steps only
            output = super().predict_step(*args, **kwargs)
        if self.layout.cp > 1:  # predictions in token order, whole, as on one device
            output = gather_batch(output, self._views[MeshAxis.CP], self.options.context.style)
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        if self._pipeline is not None:
            scaler = getattr(
                self.precision_plugin, "scaler", None
            )  # fp16: the schedule scales its losses as the scaler
            loss_scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
            self._pipeline.begin_step(trainer.accumulate_grad_batches, loss_scale)
        if self.compression_run is not None:
            self.compression_run.begin_step(trainer.global_step)
        with pipeline_scope(self._pipeline):
            output = super().training_step(*args, **kwargs)
        if self._nonfinite is not None:  # recorded on the device each step; checked on logging steps (see its module)
            self._nonfinite.record(output.get("loss") if isinstance(output, dict) else output, trainer.global_step)
            if is_logging_step(trainer):
                self._nonfinite.check(self.root_device)
        return output

    @override
    def on_train_end(self) -> None:
        if self._nonfinite is not None:
            self._nonfinite.check(self.root_device)  # the steps since the last logging step
        if self._pipeline is not None:
            self._pipeline.end_training()  # 2bw drains its pipeline (lit_mesh/parallel/pipeline/twobw.py)
        super().on_train_end()

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any
    ) -> Tensor:
        # Lightning's own backward; under pp the loss from loss_of hands the schedule's gradients to the parameters
        closure_loss = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._pipeline is not None:
            self._pipeline.check_handed_over()
        return closure_loss

    # ---- collectives over the right groups ----------------------------------------------------------------

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Accumulating micro-batches: sharded gradients reduce-scattered each time, the rest deferred (see its doc)
        zero_stage = self.options.data.zero_stage
        keep_sharded = self.layout.dp_shard * self.layout.cp > 1 and self.compression_run is None and zero_stage != 1
        with defer_gradient_reduction(self.model, keep_sharded, keep_gathered=zero_stage < 3):
            yield

    @override
    def reduce(
        self,
        tensor: Union[Tensor, Any],
        group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Union[Tensor, Any]:
        """Reduce over dp x cp by default: tp (and pp) ranks hold copies of the same value, not more samples."""
        if self.reductions is None:
            return tensor
        return self.reductions.reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Agree over every rank (ModelCheckpoint, EarlyStopping): the world, not reduce()'s dp x cp group."""
        if not _distributed_is_initialized():
            return decision
        votes = _sync_ddp(torch.tensor(int(decision), device=self.root_device), reduce_op=ReduceOp.SUM)  # type: ignore[arg-type]  # torch's RedOpType is the ReduceOp Lightning names
        return bool(votes == self.world_size) if all else bool(votes)

    # ---- checkpoints --------------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded saves are atomic (NAME.partial, renamed to NAME once every rank has written): CheckpointWriter."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._nonfinite is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._nonfinite.check(self.root_device)  # never write NaN weights over a good checkpoint
        if self._pipeline is not None:
            self._pipeline.before_save()  # 2bw: what a checkpoint cannot hold of its pipeline in flight
        if (
            self.global_batch_splits > 1
        ):  # what its loop counters count in (lit_mesh/reliability/replan.py); absent means 1
            checkpoint[SPLITS_KEY] = self.global_batch_splits
        if storage_options is not None or not self._save_distributed_checkpoint:
            if _is_sharded_checkpoint(Path(filepath)):  # Lightning would delete the directory for the file
                refuse_overwriting_other_files(Path(filepath))
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        refuse_overwriting_other_files(path)  # on every rank: all raise together
        self._checkpoints.save(
            dcp_writable(checkpoint),  # experts split by halves over tp as plain shards (lit_mesh/checkpoint/files.py)
            path,
            write=lambda state, directory: super(MeshStrategy, self).save_checkpoint(state, directory, storage_options),
            compression=self.compression_run,
            layout=self.layout.describe(),
            finish_now=trainer is None or trainer.state.status != TrainerStatus.RUNNING,  # no teardown will wait
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # retention never deletes the newest complete checkpoint (lit_mesh/checkpoint/files.py)
            remove_checkpoint(Path(filepath))

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        assert self.model is not None
        options = optimizer_state_options(pipeline=self.layout.pp > 1)  # why this format: lit_mesh/checkpoint/files.py
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save in flight is on disk under its name (no-op otherwise)."""
        self._checkpoints.wait()

    @override
    def teardown(self) -> None:
        self.wait_for_checkpoint()  # the last checkpoint of a run is complete when fit() returns
        if self._hang_watch is not None:
            self._hang_watch.stop()
        super().teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._hang_watch is not None:
            self._hang_watch.on_exception(exception)  # torch's collective timeout -> CollectiveHangError, named
        super().on_exception(exception)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        path = Path(self.broadcast(checkpoint_path))
        assert self.lightning_module is not None
        # validate/test/predict restore the weights alone, as FSDPStrategy does: a checkpoint saved with
        # weights_only=True holds no optimizer state, and the optimizers a fit left behind take none
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _reshard(self.model)
        if not path.is_dir():  # a full single-file checkpoint: never unpickling code unless the caller says so
            kept = self.optimizers
            self.optimizers = kept if fitting else []
            try:
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only is not False)
            finally:
                self.optimizers = kept
        else:
            assert self.model is not None
            optimizers = {f"optimizer_{i}": o for i, o in enumerate(self.optimizers)} if fitting else {}
            strict = self.lightning_module.strict_loading
            tied = self._pipeline.tied if self._pipeline is not None else None
            aliases = tied.aliases_under(self.model) if tied is not None else None  # a tied copy's other name
            with torch.inference_mode(False):  # Lightning calls test(ckpt_path=...) within the user's inference_mode
                checkpoint = self._checkpoints.load(
                    path, self.model, optimizers, strict, self.compression_run, self.layout.describe(), aliases
                )
        rescale_batch_progress(checkpoint, self.global_batch_splits)
        return checkpoint

    @property
    @override
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(
                "Accessing the device mesh before processes have initialized is not allowed: MeshStrategy builds it"
                " in setup_environment; use it from configure_model on"
            )
        return self._device_mesh


MeshStrategy.__doc__ = f"{MeshStrategy.__doc__}\n{args_docstring()}\n"  # LightningCLI's help reads it

StrategyRegistry.register(
    MeshStrategy.strategy_name,
    MeshStrategy,
    override=True,
    description="N-D mesh: DDP/FSDP/HSDP x TP/SP from the model's plan",
)
