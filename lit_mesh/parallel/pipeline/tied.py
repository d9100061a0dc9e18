"""Tied parameters under pp: one matrix used by the first and the last stage (tied input and output embeddings).

Cutting the model into stages leaves the embedding on the first stage and the output head on the last, each rank
with its own copy of the shared matrix. The copies stay one matrix as Megatron's embedding group keeps them:
- drawn alike: the last stage's copy is initialised under the name the whole model gives it (init.py's
  `draw_as`), so both copies start from the one-device values; then the first stage's copy is broadcast to the
  last (an initialiser without names, such as transformers', draws per module);
- summed gradients: after the schedule's backward of each step, the copies' gradients are all-reduced over a group
  of the two ranks (first and last stage of the same pipeline), before clipping and the optimizer step; equal
  gradients and equal optimizer states keep the copies equal;
- counted once: the global gradient norm (clipping, GradientNormMonitor) leaves out every copy but the one under
  the whole model's name.

Where one rank holds both uses (V placement) the two modules share the parameter itself: nothing to sum.
Only modules of the PipelinePlan (first, last) may share parameters across stages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lit_mesh.errors import PipelineConfigError
from lit_mesh.mesh import MeshAxis, group_pool
from lit_mesh.plan import ParallelPlan


def tied_name_groups(module: nn.Module) -> list[list[str]]:
    """The names under which one parameter appears more than once, per parameter, in `named_parameters` order (the
    first name is the one `named_parameters()` and the whole model's checkpoint give it)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _holder_stage(name: str, plan: ParallelPlan, n_stages: int) -> int:
    def among(modules: Sequence[str]) -> bool:
        return any(name.startswith(f"{module}.") for module in modules)

    if among(plan.pp.first):
        return 0
    if among(plan.pp.last):
        return n_stages - 1
    raise PipelineConfigError(
        f"parameter {name!r} is tied to another, but its module is neither one of the PipelinePlan's first"
        f" modules {list(plan.pp.first)} nor its last {list(plan.pp.last)}: under pp only those may share a"
        " parameter (tied embeddings); untie it, or use pp=1"
    )


class TiedParameters:
    """This rank's copies of the parameters tied across stages, and the group that sums their gradients."""

    def __init__(
        self,
        model: nn.Module,
        groups: list[list[str]],
        plan: ParallelPlan,
        stage_ranks: Sequence[int],
        root: DeviceMesh,
    ) -> None:
        self.model = model
        self.group: Optional[dist.ProcessGroup] = None
        self.names: list[str] = []  # this rank's copies to sum: held here and on another stage's rank
        # this rank's copies that the whole model names otherwise -> that name: the norm counts them on another
        # rank, and a checkpoint without pp holds their optimizer state under that name
        self.aliases: dict[str, str] = {}
        local = dict(model.named_parameters(remove_duplicate=False))
        made: set[tuple[int, ...]] = set()
        for group in groups:  # the same on every rank (the whole model's names), so every rank makes every group
            members = tuple(sorted({stage_ranks[_holder_stage(name, plan, len(stage_ranks))] for name in group}))
            if len(members) == 1:  # one rank holds every use: the modules share the parameter itself
                continue
            if members not in made:
                made.add(members)
                self.group = _embedding_group(root, members) or self.group
            held = [name for name in group if name in local]
            if held:
                self.names.append(held[0])
                if group[0] not in held:
                    self.aliases[held[0]] = group[0]
                # the whole model's copy (a group of two ranks, in pp order) gives its values to the other
                source = members.index(stage_ranks[_holder_stage(group[0], plan, len(stage_ranks))])
                self._start_equal(local[held[0]], source)

    @torch.no_grad()
    def _start_equal(self, param: Tensor, source: int) -> None:
        """Both copies start from the first's values, whatever initialised them (an initialiser that draws per
        module, such as transformers', drew the head's copy elsewhere in its sequence)."""
        local = param._local_tensor if isinstance(param, DTensor) else param
        dist.broadcast(local, group=self.group, group_src=source)

    @contextmanager
    def summing_gradients(self, _inputs: Tensor, _loss_scale: float) -> Iterator[None]:
        """Around the schedule's step (a runner step context): afterwards the copies' gradients are summed."""
        yield
        if self.group is None:
            return
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        for name in self.names:
            param = parameters[name]
            if param.grad is None:  # both ranks take part in every sum, whatever reached their copy
                param.grad = torch.zeros_like(param)
            grad = param.grad
            # a DTensor's shard: the same shard on both ranks (equal coordinates on every other mesh dim)
            dist.all_reduce(grad._local_tensor if isinstance(grad, DTensor) else grad, group=self.group)

    def counted_once(self, parameters: Sequence[Tensor]) -> list[Tensor]:
        """`parameters` without the copies the global gradient norm counts on another rank."""
        skip = {id(p) for name, p in self.model.named_parameters(remove_duplicate=False) if name in self.aliases}
        return [p for p in parameters if id(p) not in skip]

    def aliases_under(self, root: nn.Module) -> dict[str, str]:
        """`aliases` by their names in `root`, the module that holds the model (the LightningModule)."""
        prefix = next(name for name, module in root.named_modules() if module is self.model)
        dot = f"{prefix}." if prefix else ""
        return {dot + copy: dot + whole for copy, whole in self.aliases.items()}


def _embedding_group(root: DeviceMesh, members: tuple[int, ...]) -> Optional[dist.ProcessGroup]:
    """This rank's group of the ranks at pp coordinates `members` with equal coordinates on every other mesh dim
    (one per pipeline); None where this rank is in none. A collective: every rank makes every group."""
    names = root.mesh_dim_names or ()
    ranks = root.mesh.movedim(names.index(MeshAxis.PP), -1)
    pipelines = ranks.reshape(-1, ranks.shape[-1])
    partition = [[int(row[m]) for m in members] for row in pipelines]
    return group_pool(root).group_of_rank(partition)
