"""MeshStrategy: the Lightning lifecycle. It orchestrates; lit_mesh.mesh and lit_mesh.parallel do the work.

Built on Lightning's ModelParallelStrategy (process group, distributed checkpoints, optimizer state) and
extends it from 2D to the N-D mesh, with plans applied for the user.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh

from lit_mesh.async_save import AsyncCheckpointSaver, staged_state, write_metadata
from lit_mesh.checkpoint import (
    failed_save_reported,
    load_sharded_checkpoint,
    optimizer_state_options,
    publish_checkpoint,
    refuse_overwriting_other_files,
    remove_checkpoint,
)
from lit_mesh.comm import hierarchical
from lit_mesh.comm.compression import CompressionRun
from lit_mesh.comm.hierarchical import AllReduceMode, Hierarchy, build_hierarchy, check_allreduce_mode
from lit_mesh.comm.options import CompressionConfigError, CompressionOptions, resolve_compression
from lit_mesh.comm.state import load_compression_state, save_compression_state
from lit_mesh.elastic import init_process_group_for_attempt
from lit_mesh.grad_norm import clip_grad_norm_
from lit_mesh.mesh import (
    MeshConfigError,
    MeshLayout,
    MeshViews,
    build_device_mesh,
    check_degrees,
    lightning_sizes,
    per_node_degrees,
    resolve_layout,
)
from lit_mesh.meta_writes import record_meta_writes
from lit_mesh.parallel.apply import Parallelized, is_user_parallelised, materialize, parallelize
from lit_mesh.parallel.checkpointing import ActivationCheckpointing, check_activation_checkpointing
from lit_mesh.parallel.compile import check_compile
from lit_mesh.parallel.context import CPStyle, check_cp_style, gather_batch, refuse_cp_without_plan, shard_batch
from lit_mesh.parallel.data import fsdp_roots, refuse_fsdp1
from lit_mesh.parallel.pipeline import PipelineRunner, attach_runner, check_pipeline_settings
from lit_mesh.precision import check_precision_plugin
from lit_mesh.progress import count_steps_in_progress_bar
from lit_mesh.topology import Topology, as_topology, topology_from_environment



class MeshStrategy(ModelParallelStrategy):
    """Train on one N-D DeviceMesh (pp, dp_replicate, dp_shard, cp, tp) with the model's parallel plan applied.

    Args:
        dp: data-parallel degree; alone it means FSDP over dp ranks. "auto" fills the world size.
        dp_replicate: replicas (DDP); with dp_shard > 1 as well, HSDP.
        dp_shard: FSDP shards per replica; "auto" fills the world size (the default when no dp degree is given).
        tp: tensor-parallel degree (innermost dim: keep it inside a node); "auto": the devices of a node.
        cp: context-parallel degree: each sample's sequence is split over cp ranks (needs a plan that declares
            its attention and positions); FSDP then shards over dp_shard x cp.
        cp_style: "ring" (K/V blocks circulate, load-balanced causal), "ulysses" (all-to-all to head shards;
            cp must divide the heads per tp rank) or "allgather" (all-gather K/V, load-balanced causal).
        pp: pipeline-parallel degree (outermost dim: stages may span nodes). The LightningModule computes its loss
            with `lit_mesh.loss_of(self.model, loss_fn, inputs, targets)` (and its outputs with `output_of`).
        ep: expert-parallel degree, borrowed from dp_shard x cp (it adds no ranks): experts of the plan's MoE
            layers are split over ep, their weights FSDP-sharded over dp_shard x cp / ep.
        pp_schedule: "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zero_bubble" (interleaved zero bubble),
            "zbv" or "dualpipev" (V-shaped, 2 stages per rank).
        pp_microbatches: micro-batches per step (must divide each pipeline replica's batch); default pp.
        pp_stages_per_rank: virtual stages per rank for the interleaved schedules (default 2 there, else 1).
        pp_split: blocks per stage, e.g. [3, 5]; default: balanced, counting embedding and head as one block each.
        sequence_parallel: shard activations over the sequence between TP regions (needs tp to divide it).
        activation_checkpointing: "none", "full" (recompute whole blocks in backward) or "selective" (keep
            matmul, attention and collective outputs, recompute the rest).
        ac_every_n_blocks: checkpoint every n-th block only (1: all blocks).
        compile_blocks: torch.compile each block's forward (after checkpointing, before FSDP); data-parallel
            layouts only for now (with tp > 1 it is refused: compiled DTensor blocks get wrong gradients).
        compile_backend: the torch.compile backend ("inductor"; "aot_eager" compiles fast and generates no code).
        stop_on_nonfinite_loss: stop with the step and the ranks when a training loss is NaN or infinite (one
            tiny all-reduce per step, so that every rank stops together instead of hanging).
        save_distributed_checkpoint: sharded checkpoints (a directory, one file per rank) or one full file.
        async_save: write sharded checkpoints in a background thread (training goes on once the state is
            copied in memory); the directory appears under its name only when every rank has written it.
        grad_compression: compress every data-parallel gradient reduction: "fp16", "bf16", "powersgd", "onebit",
            "topk", or a `lit_mesh.CompressionOptions` (rank, ratio, warm-up, schedule, ...); None: off.
            See lit_mesh/comm/compression.py.
        topology: nodes, devices per node and link bandwidths/latencies (`lit_mesh.Topology`); default: read
            from the cluster environment (SLURM, torchrun) and Trainer(num_nodes, devices). Given explicitly, it
            must agree with them (on one machine it may split the devices into simulated nodes).
        strict_topology: refuse a tensor-parallel group that would cross nodes (else: a warning with the numbers).
        allreduce: replicated gradients (DDP, HSDP's replicate dim) and metric reductions: "hierarchical"
            (reduce-scatter in the node, all-reduce of the 1/g piece between nodes, all-gather in the node; with
            grad_compression only the inter-node all-reduce is compressed), "flat", or "auto" (the topology's
            alpha-beta cost model decides per tensor size). See lit_mesh/comm/hierarchical.py.
        data_parallel_size, tensor_parallel_size: ModelParallelStrategy's names, with its meaning: "auto" (the
            default of the one not given) is the nodes / the devices per node; not together with dp or tp.
            The mesh answers to "data_parallel" and "tensor_parallel" whichever names are used.
        process_group_backend: "gloo", "nccl", ...; default from the device.
        timeout: timeout of collectives.
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
        sequence_parallel: bool = True,
        activation_checkpointing: ActivationCheckpointing = "none",
        ac_every_n_blocks: int = 1,
        compile_blocks: bool = False,
        compile_backend: str = "inductor",
        stop_on_nonfinite_loss: bool = True,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        grad_compression: Union[str, CompressionOptions, None] = None,
        topology: Optional[Topology] = None,
        strict_topology: bool = False,
        allreduce: AllReduceMode = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        data_parallel_size: Union[int, Literal["auto"], None] = None,
        tensor_parallel_size: Union[int, Literal["auto"], None] = None,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._degrees: dict[str, Any] = dict(dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, pp=pp, ep=ep)
        check_degrees(**self._degrees)  # what needs no world size fails here, in the user's process
        self._lightning_sizes = lightning_sizes(self._degrees, data_parallel_size, tensor_parallel_size)
        self.pipeline_settings = check_pipeline_settings(pp, pp_schedule, pp_microbatches, pp_stages_per_rank, pp_split)
        if pp > 1 and cp > 1:
            raise MeshConfigError(
                f"pp={pp} with cp={cp}: pipeline and context parallel together are not supported yet; use one of them"
            )
        self._pipeline: Optional[PipelineRunner] = None
        check_activation_checkpointing(activation_checkpointing, ac_every_n_blocks)
        check_cp_style(cp_style)
        self.cp_style = cp_style
        self.sequence_parallel = sequence_parallel
        self.activation_checkpointing = activation_checkpointing
        self.ac_every_n_blocks = ac_every_n_blocks
        if compile_blocks:
            check_compile(compile_backend, tp=tp)
        self.compile_backend = compile_backend if compile_blocks else None
        self.stop_on_nonfinite_loss = stop_on_nonfinite_loss
        if async_save and not save_distributed_checkpoint:
            raise ValueError("async_save=True writes sharded checkpoints: keep save_distributed_checkpoint=True")
        self._async_saver = AsyncCheckpointSaver() if async_save else None
        self.grad_compression_options = resolve_compression(grad_compression)
        if self.grad_compression_options is not None and not save_distributed_checkpoint:
            rank_zero_warn("grad_compression: single-file checkpoints do not hold its per-rank state; a resume restarts it")
        self.grad_compression: Optional[CompressionRun] = None  # the run's state, made in setup()
        self._layout: Optional[MeshLayout] = None
        self.mesh_views: Optional[MeshViews] = None
        check_allreduce_mode(allreduce)
        self.allreduce = allreduce
        self.strict_topology = strict_topology
        self._given_topology = as_topology(topology)
        # the run's topology, once the Trainer has set num_nodes and devices
        self.topology: Optional[Topology] = self._given_topology
        self.replicate_hierarchy: Optional[Hierarchy] = None  # DDP/HSDP gradients (None: flat)
        self.metric_hierarchy: Optional[Hierarchy] = None  # reduce() over dp x cp (None: flat)

    # ---- degrees and mesh -------------------------------------------------------------------------------

    @property
    def layout(self) -> MeshLayout:
        """The resolved degrees (known once the Trainer has set devices and num_nodes)."""
        if self._layout is None:
            degrees = per_node_degrees(self._degrees, self._lightning_sizes, self.num_nodes, self.num_processes)
            self._layout = resolve_layout(self.num_processes * self.num_nodes, **degrees)
        return self._layout

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every tp (and later cp, pp) rank of one replica reads the same batch
        if self.mesh_views is None:
            raise RuntimeError("MeshStrategy.distributed_sampler_kwargs exists once the processes have started")
        dp_mesh = self.mesh_views.dp
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    def _configure_launcher(self) -> None:
        # Called by the Trainer before any process is spawned: validate here, not after spawning.
        check_precision_plugin(self.precision_plugin)
        layout = self.layout
        if layout.pp > 1 and str(self.precision_plugin.precision) == "16-mixed":
            raise MeshConfigError(
                f"pp={layout.pp} with fp16 loss scaling: the pipeline schedule runs the backward itself, outside the"
                " scaler; use precision='bf16-mixed' (no scaler needed) or pp=1"
            )
        if self.grad_compression_options is not None and layout.data_parallel == "none":
            raise CompressionConfigError(
                f"grad_compression={self.grad_compression_options.mode!r} but the mesh has no data-parallel dim"
                f" ({layout.describe()}): there is no gradient reduction to compress; give dp or dp_replicate > 1,"
                " or set grad_compression=None"
            )
        assert self.cluster_environment is not None
        self.topology = topology_from_environment(
            self.cluster_environment, self.num_nodes, self.num_processes, self._given_topology
        )
        for warning in self.topology.check_layout(layout, self.strict_topology):
            rank_zero_warn(warning)
        # Always configure the launcher: with processes created externally (SLURM, torchrun) it spawns
        # nothing but still validates the cluster settings.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _setup_distributed(self) -> None:
        # torchrun --max-restarts: each attempt on its own rendezvous keys (lit_mesh/elastic.py says why)
        init_process_group_for_attempt(self.cluster_environment, self._get_process_group_backend(), self._timeout, self.root_device)
        super()._setup_distributed()

    def setup_environment(self) -> None:
        self._setup_distributed()
        self.mesh_views = build_device_mesh(self.layout, self.root_device.type)
        self._device_mesh = self.mesh_views.root
        self._setup_topology()
        if self._async_saver is not None:
            self._async_saver.setup()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _setup_topology(self) -> None:
        """Print where every rank sits; make the node-local/cross-node groups of the hierarchical all-reduces."""
        layout, views = self.layout, self.mesh_views
        assert views is not None
        if self.topology is None:  # _configure_launcher did not run (a Strategy used outside the Trainer)
            self.topology = Topology(nodes=self.num_nodes, devices_per_node=self.num_processes)
        ranks = views.root.mesh
        self.replicate_hierarchy = self.metric_hierarchy = None
        if layout.dp_replicate > 1:
            self.replicate_hierarchy = build_hierarchy(
                ranks, (1,), views.root.get_group("dp_replicate"), self.topology, self.allreduce, "dp_replicate"
            )
        if views.dp_cp.size() > 1:
            self.metric_hierarchy = build_hierarchy(
                ranks, (1, 2, 3), views.dp_cp.get_group(), self.topology, self.allreduce, "dp_cp"
            )
        reductions = [
            f"{h.dim} all-reduce {h.mode}: {h.nodes} nodes x {h.per_node} ranks per node"
            for h in (self.replicate_hierarchy, self.metric_hierarchy)
            if h is not None
        ]
        rank_zero_info(self.topology.startup_report(layout, reductions))  # the layout, once, as one block

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # as ModelParallelStrategy: trainer.init_module() keeps real weights unless empty_init=True
        with (torch.device("meta") if empty_init else nullcontext()), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        # configure_model builds on the meta device (setup() shards, then materialises); values written into
        # meta weights there are carried through materialisation, or refused (lit_mesh/meta_writes.py)
        assert self.lightning_module is not None
        with record_meta_writes(self.lightning_module):
            yield

    # ---- applying the plans -------------------------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        count_steps_in_progress_bar(trainer)
        refuse_fsdp1(self.model, type(self).__name__)
        precision = str(self.precision_plugin.precision)
        self.model = self.precision_plugin.convert_module(self.model)  # bf16-true: cast while still on meta
        if self.grad_compression_options is not None and self.grad_compression is None:
            self.grad_compression = CompressionRun(self.grad_compression_options, self.root_device)
        if is_user_parallelised(self.model):
            if self.layout.pp > 1:
                raise MeshConfigError(
                    f"pp={self.layout.pp}: configure_model parallelised the model itself, so MeshStrategy cannot cut"
                    " it into pipeline stages; declare a parallel_plan() instead, or use pp=1"
                )
            if self.grad_compression is not None and not self.grad_compression.sites:  # not hooked by us
                raise CompressionConfigError(
                    "grad_compression hooks into the data parallelism MeshStrategy applies, but configure_model"
                    " parallelised the model itself; let MeshStrategy apply it (a parallel_plan()), or drop grad_compression"
                )
            rank_zero_info("MeshStrategy: configure_model parallelised the model itself; no plan is applied")
            refuse_cp_without_plan(self.layout.cp, type(self.lightning_module).__name__)
            done = Parallelized([])
        else:
            done = parallelize(
                self.model,
                self.mesh_views,
                self.layout,
                sequence_parallel=self.sequence_parallel,
                precision=precision,
                activation_checkpointing=self.activation_checkpointing,
                ac_every_n_blocks=self.ac_every_n_blocks,
                compile_backend=self.compile_backend,
                pipeline=self.pipeline_settings,
                cp_style=self.cp_style,
                grad_compression=self.grad_compression,
                replicate_hierarchy=self.replicate_hierarchy,
            )
        materialize(self.model, done.owners, self.root_device)
        self.model_to_device()
        if done.stages is not None:
            self._setup_pipeline(done)
        # Lightning's default clipping cannot mix DTensors of different meshes; clip by the global norm.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_pipeline(self, done: Parallelized) -> None:
        owner = done.owners[0].module
        assert done.stage_ranks is not None and self.mesh_views is not None
        self._pipeline = PipelineRunner(
            done.stages,
            self.pipeline_settings,
            self.mesh_views["pp"].get_group(),
            done.stage_ranks,
            device=self.root_device,
            parameters=lambda: list(owner.parameters()),
        )
        attach_runner(owner, self._pipeline)

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.layout.cp > 1:  # every loop (fit, validate, test, predict): each cp rank keeps its part of the sequence
            batch = shard_batch(batch, self.mesh_views["cp"], self.cp_style)
        return batch

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        if self.layout.cp > 1:  # predictions in token order, whole, as on one device
            output = gather_batch(output, self.mesh_views["cp"], self.cp_style)
        return output

    def _clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: Union[int, float]) -> None:
        # pipeline stages hold different parameters: their norms add up over pp
        across = self.mesh_views["pp"].get_group() if self._pipeline is not None else None
        clip_grad_norm_(self.precision_plugin.main_params(optimizer), float(clip_val), across=across)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            assert self.lightning_module is not None
            self._pipeline.accumulation = self.lightning_module.trainer.accumulate_grad_batches
        if self.grad_compression is not None:
            self.grad_compression.begin_step(self.lightning_module.trainer.global_step)
        output = super().training_step(*args, **kwargs)
        if self.stop_on_nonfinite_loss:
            loss = output.get("loss") if isinstance(output, dict) else output
            if isinstance(loss, Tensor):
                self._stop_if_nonfinite(loss)
        return output

    def _stop_if_nonfinite(self, loss: Tensor) -> None:
        # one slot per rank: every rank learns which ranks failed, so all stop together
        bad = torch.zeros(self.world_size, device=self.root_device)
        bad[self.global_rank] = float(not torch.isfinite(loss.detach()).all())
        if _distributed_is_initialized():
            torch.distributed.all_reduce(bad)
        if bad.any():
            ranks = bad.nonzero().flatten().tolist()
            step = self.lightning_module.trainer.global_step if self.lightning_module is not None else "?"
            raise FloatingPointError(
                f"non-finite training loss at step {step} on rank(s) {ranks}: stopping. Lower the learning rate,"
                " set gradient_clip_val, try precision='32-true', or resume from the last checkpoint"
                " (stop_on_nonfinite_loss=False turns this check off)"
            )

    def backward(self, closure_loss: Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # the schedule ran forward and backward inside training_step (lit_mesh.loss_of); the hooks still run
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._pipeline.add_fresh_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # ---- collectives over the right groups ----------------------------------------------------------------

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Accumulating micro-batches: keep gradients local, reduce once at the last one.
        roots = fsdp_roots(self.model) if self.model is not None else []
        for root in roots:
            root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for root in roots:
                root.set_requires_gradient_sync(True)

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        """Reduce over dp x cp by default: tp (and pp) ranks hold copies of the same value, not more samples."""
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        if group is None:
            group = self.mesh_views.dp_cp.get_group()
            op = reduce_op.lower() if isinstance(reduce_op, str) else reduce_op
            h = self.metric_hierarchy
            summed = op in ("sum", "mean", "avg") or (not isinstance(op, str) and op == ReduceOp.SUM)
            if h is not None and summed and tensor.is_floating_point() and h.use_hierarchical(tensor.nbytes):
                return hierarchical.all_reduce(tensor, h, average=op in ("mean", "avg"))
        return _sync_ddp(tensor, group=group, reduce_op=reduce_op)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Sharded saves are atomic: written to NAME.partial, renamed to NAME once every rank has finished.

        A crash mid-save leaves the previous checkpoint under NAME (e.g. last.ckpt) untouched and loadable.
        """
        if storage_options is not None or not self._save_distributed_checkpoint:
            if _is_sharded_checkpoint(Path(filepath)):  # Lightning would delete the directory for the file
                refuse_overwriting_other_files(Path(filepath))
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        refuse_overwriting_other_files(path)  # on every rank: all raise together
        staging = path.with_name(path.name + ".partial")
        self.wait_for_checkpoint()  # the previous save may still write this staging directory
        if self.global_rank == 0 and staging.exists():
            shutil.rmtree(staging)  # left by an earlier crash
        self.barrier()
        if self.grad_compression is not None:  # per-rank residuals, beside the shards
            save_compression_state(self.grad_compression, staging, self.global_rank, self.world_size, self.layout.describe())
        if self._async_saver is not None:
            state = staged_state(checkpoint)
            if self.global_rank == 0:
                write_metadata(checkpoint, staging, _METADATA_FILENAME)
            self._async_saver.save(state, staging, path, coordinator=self.global_rank == 0)
            trainer = getattr(self.lightning_module, "_trainer", None)
            if trainer is None or trainer.state.status != TrainerStatus.RUNNING:
                self.wait_for_checkpoint()  # a save outside fit/validate has no teardown to wait for it
            return
        with failed_save_reported(staging, path):
            super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier()  # every shard and the metadata are on disk
        if self.global_rank == 0:
            publish_checkpoint(staging, path)
        self.barrier()

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # retention never deletes the newest complete checkpoint (lit_mesh/checkpoint.py)
            remove_checkpoint(Path(filepath))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        assert self.model is not None
        options = optimizer_state_options(pipeline=self.layout.pp > 1)  # why this format: lit_mesh/checkpoint.py
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save in flight is on disk under its name (no-op otherwise)."""
        if self._async_saver is not None:
            self._async_saver.wait()

    def teardown(self) -> None:
        self.wait_for_checkpoint()  # the last checkpoint of a run is complete when fit() returns
        super().teardown()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.wait_for_checkpoint()
        path = Path(self.broadcast(checkpoint_path))
        if not path.is_dir():  # a full single-file checkpoint
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        assert self.model is not None and self.lightning_module is not None
        optimizers = {f"optimizer_{i}": optimizer for i, optimizer in enumerate(self.optimizers)}
        loaded = load_sharded_checkpoint(path, self.model, optimizers, strict=self.lightning_module.strict_loading)
        if self.grad_compression is not None:
            load_compression_state(self.grad_compression, path, self.global_rank, self.world_size, self.layout.describe())
        return loaded

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Agree over every rank (ModelCheckpoint, EarlyStopping): the world, not reduce()'s dp x cp group."""
        if not _distributed_is_initialized():
            return decision
        votes = _sync_ddp(torch.tensor(int(decision), device=self.root_device), reduce_op=ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError(
                "Accessing the device mesh before processes have initialized is not allowed: MeshStrategy builds it"
                " in setup_environment; use it from configure_model on"
            )
        return self._device_mesh


StrategyRegistry.register(
    MeshStrategy.strategy_name, MeshStrategy, override=True, description="N-D mesh: DDP/FSDP/HSDP x TP/SP from the model's plan"
)
