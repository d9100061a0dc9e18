"""One real training step of one rank at the target scale, in this process: the model built on the meta device,
lit_mesh's own `parallelize` applied over torch's fake process group, the rank's shards materialised as real
(small) tensors, then forward, loss, backward and an AdamW step on a micro-batch at that rank's shapes.

The fake group runs no collective; a TorchDispatchMode sees each one (the c10d ops FSDP2 and P2P call, the
functional ones DTensor, CP and EP call) and counts its bytes by process group, which `dim_of_groups` names by
the mesh dims whose ranks it holds:
- all-gather: its output (the gathered tensor); reduce-scatter: its input; all-reduce: its tensor;
- all-to-all: what this rank sends; send / recv: the message.
These are the sizes the ring formulas take (lit_mesh.comm.topology): the planner's byte terms are in the same unit.

The fake all-to-all leaves its output as it was; the mode copies the input there (c10d's and the functional one's),
as if each peer sent this rank what this rank sends it (EP's token counts then agree with the tokens sent: balanced
traffic, as the planner assumes; ep_dispatch="by_node" reads its assignments' table back). Under "by_node" the routers
pick uniformly at random (`route_uniformly`): the bytes between nodes depend on the routing there.
A fake receive leaves its buffer as it was; the mode fills it with ones, as if the peer sent ones.

Pipelines (pp > 1): lit_mesh's runner drives torch's schedule over `microbatches` micro-batches, so every send and
receive of the schedule runs. torch's stages would learn their shapes from their peers (a vote, then the shapes as
pickled objects), which fake ranks cannot answer: each stage is given them instead (static shapes), from a forward
of one micro-batch without autograd; every stage after the first takes the hidden states (lit_mesh cuts the model
between blocks: `stage_boundary`), so the step runs a rank of any stage.
The vote's ones say every stage has static shapes, as each rank of this simulation does. Activations are not
measured under pp: forwards and backwards interleave, so no one point holds what the forward keeps. What is measured
under pp: the unsharded gradients FSDP2 holds when the schedule reduces them (torch's stages run every backward
without gradient sync and reduce once at the end: `accumulated_grads`, the planner's FSDP buffers term).

Activations: the bytes of the storages the forward and the loss create that are still alive when backward starts
(what the step holds into backward: autograd's saved tensors, checkpointed blocks' inputs, the logits), without
parameters (the FSDP root's gathered weights stay alive too, and are counted apart). A wrapper tensor subclass
(the functional collectives' AsyncCollectiveTensor, torchao's float8 tensors) counts by the tensors it wraps: its
own storage is a placeholder the size of its nominal dtype, no memory (counted, it made a collective's output
twice and a float8 weight a bf16 one).
"""

from __future__ import annotations

import gc
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from lit_mesh.comm.topology import Topology
from lit_mesh.loss import cross_entropy
from lit_mesh.mesh import MeshAxis, MeshLayout, MeshViews, build_device_mesh, folded_expert_meshes
from lit_mesh.options import MeshDegrees, MeshOptions
from lit_mesh.parallel.activation_checkpointing import MemoryOptions
from lit_mesh.parallel.apply import Parallelized, parallelize
from lit_mesh.parallel.context.layout import ContextOptions, shard_batch
from lit_mesh.parallel.data import DataParallelOptions
from lit_mesh.parallel.expert import ExpertOptions, folds_experts
from lit_mesh.parallel.expert_by_node import EPDispatch, node_groups
from lit_mesh.parallel.float8 import Float8Options
from lit_mesh.parallel.pipeline.runner import ScheduleRunner
from lit_mesh.parallel.pipeline.schedules import PipelineSettings
from lit_mesh.parallel.pipeline.split import Stage
from lit_mesh.planner.pipeline_model import ONE_F_ONE_B, Schedule
from lit_mesh.planner.shapes import build_model
from lit_mesh.planner.vocabulary import ac_every, ac_mode, ac_others

StageExamples = dict[int, tuple[torch.Tensor, torch.Tensor]]  # stage index -> (an input, an output) of one micro-batch

# the c10d / functional ops by what they do, and which argument's bytes the count takes
_OPS = {
    "allgather_": ("all_gather", "output"),
    "_allgather_base_": ("all_gather", "output"),
    "all_gather_into_tensor": ("all_gather", "output"),
    "all_gather_into_tensor_out": ("all_gather", "output"),
    "reduce_scatter_": ("reduce_scatter", "input"),
    "_reduce_scatter_base_": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "allreduce_": ("all_reduce", "input"),
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "alltoall_base_": ("all_to_all", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "combine_expert_outputs": ("all_to_all", "input"),  # lit_mesh's (lit_mesh/parallel/expert_combine.py)
    "exchange_counts": ("all_to_all", "input"),  # lit_mesh's (lit_mesh/parallel/expert_counts.py)
    "send": ("send", "input"),
    "recv_": ("recv", "input"),
    "broadcast_": ("broadcast", "input"),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_name(args: tuple) -> str | None:
    """The process group of a collective: a functional op names it, a c10d op passes it (a ScriptObject)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            return dist.ProcessGroup.unbox(a).group_name
    for a in reversed(args):
        if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product"):
            return a
    return None


def _tensors(args: tuple) -> list[Any]:
    return [
        a for a in args if isinstance(a, torch.Tensor) or (isinstance(a, list) and a and isinstance(a[0], torch.Tensor))
    ]


class CollectiveCounter(TorchDispatchMode):
    """Bytes of every collective by (process group name, operation)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional", "lit_mesh") and name in _OPS:
            kind, which = _OPS[name]
            tensors = _tensors(args)
            group = _group_name(args)
            if func.namespace == "c10d":  # (outputs, inputs, group, ...) or (tensors, group, ...)
                data = tensors[0] if (which == "output" or len(tensors) == 1) else tensors[1]
                if name == "alltoall_base_":
                    tensors[0].copy_(tensors[1])  # each peer sends this rank what it sends them (module doc)
                if name == "recv_":
                    tensors[0][0].fill_(1)  # the peer sends ones (module doc)
            else:
                data = out if which == "output" else tensors[0]
                if name == "all_to_all_single" and out.shape == tensors[0].shape:
                    out.copy_(tensors[0])  # as the c10d one (module doc): by-node dispatch's table is read back
                if name == "exchange_counts":  # the counts it receives are those it sends, and so is the host copy
                    out[0].copy_(tensors[0])
                    out[1].copy_(torch.stack([tensors[0], tensors[0]]))
            if group is not None:
                self.bytes[(group, kind)] += _nbytes(data)
                self.calls[(group, kind)] += 1
        return out


class LiveStorages(TorchDispatchMode):
    """The storages op outputs create while active (a DTensor's: its local one); alive() sums those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            for inner in _data_tensors(t):
                ref = StorageWeakRef(inner.untyped_storage())
                self._refs.setdefault(ref.cdata, ref)
        return out

    def alive(self) -> dict[int, int]:
        """Storage key -> bytes, for the recorded storages still alive now."""
        out = {}
        for key, ref in self._refs.items():
            storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(key)
            if storage is not None:
                out[key] = storage.nbytes()
        return out


def _data_tensors(t: Any) -> list[torch.Tensor]:
    """The tensors holding `t`'s data: a DTensor's local shard, a wrapper subclass's inner tensors (torchao's float8
    tensors: their own storage is a placeholder the size of their nominal dtype, not memory), else `t` itself."""
    if not isinstance(t, torch.Tensor):
        return []
    t = local_tensor(t)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _data_tensors(getattr(t, name))]
    return [t]


def parameter_storages(root: nn.Module) -> set[int]:
    """Storages of the parameters and of FSDP2's gathered copies (the root's and the last block's stay gathered
    from forward to backward: the planner counts them as FSDP buffers, not activations): the unsharded parameter
    and the all-gather's output it was copied out of, where the two differ (a padded dim 0, a tp shard). FSDP2
    exposes them only on its parameter groups (private: torch has no accessor)."""
    keys = {storage_key(p) for p in root.parameters()}
    for unit in root.modules():
        group = unit._get_fsdp_state()._fsdp_param_group if isinstance(unit, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            unsharded = getattr(param, "_unsharded_param", None)
            gathered = list(getattr(param, "all_gather_outputs", None) or [])
            keys.update(storage_key(t) for t in [*gathered, *([unsharded] if unsharded is not None else [])])
    return keys


def storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(local_tensor(t).untyped_storage()).cdata


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard on this rank


@dataclass
class StepCounts:
    """What one rank's step moved and held."""

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # mesh dim -> operation -> bytes
    calls: dict[str, dict[str, int]] = field(default_factory=dict)
    activations: int | None = None  # held into backward (module doc); None: not measured (pp)
    accumulated_grads: int | None = None  # pp: FSDP2's unsharded gradients at the schedule's reduce, at most
    seconds: float = 0.0


def dim_of_groups(views: MeshViews, whole_experts: bool = False, by_node: Topology | None = None) -> dict[str, str]:
    """Process group name -> the planner's name of its mesh dim (several dims of the same ranks: joined by '=');
    `whole_experts`: MeshStrategy(expert_tp=1)'s groups for ep and the experts' FSDP; `by_node`: the topology of
    ep_dispatch="by_node", whose ep groups' parts between nodes and inside one are "ep:inter" and "ep:intra"."""
    layout = views.layout
    named = {
        "tp": (views.root, "tp"),
        "cp": (views.root, "cp"),
        "dp_replicate": (views.root, "dp_replicate"),
        "pp": (views.root, "pp"),
        "fsdp": (views.dp_shard_cp, None),
        "ep": (views.ep, None),
    }
    if whole_experts:
        folded = folded_expert_meshes(views)
        named["ep"] = (folded.ep, None)
        named["expert_fsdp"] = (folded.expert_dp, MeshAxis.EFSDP_TP if layout.dp_replicate > 1 else None)
    elif layout.ep > 1:
        named["expert_fsdp"] = (views.expert_dp, "efsdp")
    out: dict[str, list[str]] = defaultdict(list)
    for label, (mesh, dim) in named.items():
        sub = mesh[dim] if dim else mesh
        if sub.size() > 1:
            out[sub.get_group().group_name].append(label)
    split = None
    if by_node is not None and layout.ep > 1:
        ep_mesh = folded_expert_meshes(views).ep if whole_experts else views.ep
        split = node_groups(views.root, layout, whole_experts, by_node, ep_mesh.get_group())
    for label, group in zip(("ep:inter", "ep:intra"), split or ()):  # the pool's groups, made by parallelize
        if dist.get_world_size(group) > 1:
            out[group.group_name].append(label)
    return {g: "=".join(labels) for g, labels in out.items()}


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a fake step needs a process without a process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_the_world()


def forget_the_world() -> None:
    """A world's model and meshes live on in reference cycles; while they do, a later fake world in this process
    can be handed their groups ("Could not resolve the process group" after an EP world): collect them."""
    gc.collect()


def fake_step(
    config: Any,
    layout: MeshLayout,
    micro_batch: int,
    seq_len: int,
    rank: int = 0,
    precision: str = "32-true",
    ac: str = "none",
    cp_style: str = "ring",
    zero_stage: int = 3,
    schedule: Schedule = ONE_F_ONE_B,
    microbatches: int = 1,
    float8: str | None = None,
    expert_tp: int | None = None,
    ep_dispatch: EPDispatch = "all_to_all",
    devices_per_node: int = 8,
) -> StepCounts:
    """One training step of global rank `rank` (one micro-batch of `micro_batch` sequences of `seq_len` tokens;
    under pp, `schedule` over `microbatches` of them, as lit_mesh's runner drives torch's schedule; `float8`:
    MeshStrategy's float8 recipe, emulated on CPU; `expert_tp`, `ep_dispatch`: MeshStrategy's, for an MoE model, the
    nodes of `devices_per_node` ranks each)."""
    start = time.perf_counter()
    options = MeshOptions(
        mesh=MeshDegrees(sequence_parallel=layout.tp > 1),
        memory=MemoryOptions(
            activation_checkpointing=ac_mode(ac),  # type: ignore[arg-type]
            ac_every_n_blocks=ac_every(ac),
            ac_other_blocks=ac_others(ac),  # type: ignore[arg-type]
        ),
        context=ContextOptions(style=cp_style),  # type: ignore[arg-type]
        data=DataParallelOptions(zero_stage=zero_stage),  # type: ignore[arg-type]
        float8=Float8Options(float8),  # type: ignore[arg-type]
        expert=ExpertOptions(expert_tp, ep_dispatch),
    )
    topology = Topology(nodes=max(1, layout.world_size // devices_per_node), devices_per_node=devices_per_node)
    if layout.pp > 1:
        options = replace(options, pipeline=PipelineSettings(schedule.name, microbatches, schedule.stages_per_rank))
    with fake_world(rank, layout.world_size):
        root, views, done, tokens = _build(config, layout, rank, precision, options, micro_batch, seq_len, topology)
        counter, live = CollectiveCounter(), LiveStorages()
        held: int | None = None
        if layout.pp > 1:
            with _autocast(precision):
                boundary = stage_boundary(config, layout, micro_batch, seq_len, precision)
                with CollectiveCounter():  # not counted; its fake collectives answer as the counted step's do
                    examples = _stage_examples(done.stages or [], tokens, boundary)
            runner = _StaticShapesRunner(examples, done, options.pipeline, views[MeshAxis.PP].get_group(), root)
            batch = tokens.repeat(microbatches, 1)  # the schedule's micro-batches, each of this rank's shape
            with counter, _unsharded_grads_at_reduce(done.stages or []) as accumulated:
                runner.begin_step(accumulation=1)
                with _autocast(precision):
                    loss = runner.train(cross_entropy, batch, batch)
                loss.backward()  # hands the schedule's gradients to the parameters (Lightning's backward)
                torch.optim.AdamW(root.parameters(), foreach=True).step()
        else:
            with counter:
                with live, _autocast(precision):
                    model = cast(nn.Module, root.model)
                    loss = cross_entropy(model(tokens), tokens)
                params = parameter_storages(root)
                held = sum(b for ptr, b in live.alive().items() if ptr not in params)
                loss.backward()
                torch.optim.AdamW(root.parameters(), foreach=True).step()
        names = dim_of_groups(
            views, folds_experts(layout, options.expert), topology if ep_dispatch == "by_node" else None
        )
    counts = StepCounts(activations=held, accumulated_grads=accumulated[0] if layout.pp > 1 else None)
    for (group, op), n in counter.bytes.items():
        dim = names.get(group, f"group {group}")
        counts.bytes.setdefault(dim, {})[op] = counts.bytes.get(dim, {}).get(op, 0) + n
        counts.calls.setdefault(dim, {})[op] = counts.calls.get(dim, {}).get(op, 0) + counter.calls[(group, op)]
    counts.seconds = round(time.perf_counter() - start, 3)
    return counts


@contextmanager
def _unsharded_grads_at_reduce(stages: list[Stage]) -> Iterator[list[int]]:
    """[the most bytes of unsharded gradients FSDP2 holds on this rank's stages when a stage's reduce starts]."""
    most = [0]
    reduce = PipelineStage.perform_reduce_grad

    def measured(stage: PipelineStage, *args: Any, **kwargs: Any) -> Any:
        held = 0
        for module in (m for s in stages for m in s.module.modules() if isinstance(m, FSDPModule)):
            group = module._get_fsdp_state()._fsdp_param_group  # FSDP2's internals: no public view of these
            for fsdp_param in group.fsdp_params if group is not None else ():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                for grad in (fsdp_param.unsharded_accumulated_grad, getattr(unsharded, "grad", None)):
                    held += _nbytes(local_tensor(grad)) if grad is not None else 0  # tp: this rank's part
        most[0] = max(most[0], held)
        return reduce(stage, *args, **kwargs)

    setattr(PipelineStage, "perform_reduce_grad", measured)  # noqa: B010 - for this step only
    try:
        yield most
    finally:
        delattr(PipelineStage, "perform_reduce_grad")  # torch's own, inherited, again


def _build(
    config: Any,
    layout: MeshLayout,
    rank: int,
    precision: str,
    options: MeshOptions,
    micro_batch: int,
    seq_len: int,
    topology: Topology | None = None,
) -> tuple[nn.Module, MeshViews, Parallelized, torch.Tensor]:
    """The rank's parallelized model, its shards drawn at random, and its tokens of one micro-batch (cp: its part of
    the sequence, as MeshStrategy's batch hook keeps)."""
    root = nn.Module()  # stands in for the LightningModule, which holds the network as `model`
    with torch.device("meta"):
        root.model = build_model(config)
    if precision == "bf16-true":
        root.to(torch.bfloat16)
    views = build_device_mesh(layout, "cpu")
    done = parallelize(root, views, options, precision=precision, topology=topology)
    root.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in root.parameters():
            local_tensor(p).normal_(0.0, 0.02, generator=generator)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len), generator=generator)
    if options.expert.dispatch == "by_node":
        route_uniformly(root)
    if layout.cp > 1:
        tokens = shard_batch(tokens, views[MeshAxis.CP], options.context.style)
    return root, views, done, tokens


def route_uniformly(root: nn.Module) -> None:
    """Every router of the model picks its top_k experts uniformly at random (the same picks for the same token
    count: AC's recompute routes alike). What ep_dispatch="by_node" sends between nodes depends on how many nodes a
    token's experts sit on; an untrained router on random tokens sends every token to the same few experts, while the
    planner assumes routing uniform over the experts (a balanced run's). The weights stay the router's own."""

    def uniform(router: nn.Module, args: tuple, routing: Any) -> Any:
        n, n_experts = routing.probs.shape
        order = torch.rand(n, n_experts, generator=torch.Generator().manual_seed(n)).argsort(dim=1)
        expert_ids = order[:, : routing.expert_ids.shape[1]].to(routing.expert_ids.device)
        return replace(routing, expert_ids=expert_ids, weights=routing.probs.gather(1, expert_ids))

    for module in root.modules():
        if type(module).__name__ == "Router":  # the zoo MoE's (zoo/moe.py)
            module.register_forward_hook(uniform)


def stage_boundary(config: Any, layout: MeshLayout, micro_batch: int, seq_len: int, precision: str) -> torch.Tensor:
    """What one micro-batch passes between two stages: lit_mesh cuts the model between blocks, so every boundary
    carries the hidden states, on this rank's part of the sequence (cp; and tp, whose sequence parallelism shards
    the blocks' outputs), in the blocks' output dtype (autocast's bf16 under bf16-mixed). A rule rather than stage
    0's forward: a rank of a later stage does not hold stage 0 (tests/integration/test_planner_step.py checks the
    rule against that forward)."""
    tokens = seq_len // layout.cp // layout.tp
    dtype = torch.float32 if precision == "32-true" else torch.bfloat16
    return torch.zeros(micro_batch, tokens, config.dim, dtype=dtype, requires_grad=True)  # its gradient goes back


def _stage_examples(stages: list[Stage], tokens: torch.Tensor, boundary: torch.Tensor) -> StageExamples:
    """Each local stage's input and output of one micro-batch, from a forward without autograd: stage 0 takes the
    tokens, every other stage the boundary's hidden states."""
    out: StageExamples = {}
    with torch.no_grad():
        for stage in sorted(stages, key=lambda s: s.index):
            example = tokens if stage.index == 0 else boundary
            output = torch.zeros_like(stage.module(example)).requires_grad_()  # what the next stage differentiates
            if stage.index == 0 and (output.shape, output.dtype) != (boundary.shape, boundary.dtype):
                raise RuntimeError(
                    f"stage 0 passes on {tuple(output.shape)} {output.dtype}, stage_boundary says"
                    f" {tuple(boundary.shape)} {boundary.dtype}: the rule no longer describes lit_mesh's cut"
                )
            out[stage.index] = (example, output)
        for unit in (u for s in stages for u in s.module.modules()):  # as torch after its own shape inference
            if isinstance(unit, FSDPModule):
                unit.reshard()
    return out


class _StaticShapesRunner(ScheduleRunner):
    """lit_mesh's runner of torch's schedules, its stages given their shapes (fake ranks cannot answer torch's
    inference, which asks the neighbouring stages)."""

    def __init__(
        self, examples: StageExamples, done: Parallelized, settings: PipelineSettings, group: Any, root: nn.Module
    ) -> None:
        self.examples = examples
        assert done.stages is not None and done.stage_ranks is not None, "a pipeline was split (pp > 1)"
        super().__init__(
            done.stages, settings, group, done.stage_ranks, torch.device("cpu"), lambda: list(root.parameters())
        )

    def _torch_stage(self, stage: Stage, device: torch.device) -> PipelineStage:
        example, output = self.examples[stage.index]
        return PipelineStage(
            stage.module,
            stage.index,
            len(self.stage_ranks),
            device,
            input_args=example,
            output_args=output,
            group=self.group,
        )


def _autocast(precision: str) -> AbstractContextManager[Any]:
    """What Lightning's precision plugin enters around the forward."""
    return torch.autocast("cpu", torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
