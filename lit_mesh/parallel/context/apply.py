"""Context parallelism: the sequence of every sample split over the cp ranks, attention exact across the split.

torch's experimental `context_parallel` only dispatches to CUDA attention kernels, so the three styles are ours
and run on any backend (gloo/CPU, NCCL/GPU):

  ring       K/V blocks circulate around the cp group (P2P, the next block in flight while the current one is
             computed); partial results merge by log-sum-exp (online softmax). Backward circulates K/V again,
             each block travelling with its dK/dV accumulator, which arrives home after a full turn.
  ulysses    all-to-all from sequence-sharded to head-sharded, ordinary attention on H/cp heads over the whole
             sequence, all-to-all back. Grouped-query K/V travel with their own (fewer) heads, repeated only as
             far as cp must divide them.
  allgather  all-gather K/V; the local queries attend to the whole sequence (backward: reduce-scatter dK/dV).

Layout of the sequence. Ring and allgather balance causal work: the sequence is cut into 2·cp chunks and cp rank i
holds chunks i and 2·cp-1-i (an early and a late one), so every rank does the same work. Ulysses computes the
whole sequence per head, so it keeps contiguous shards (rank i holds chunk i of cp).

How it is applied: the plan names the module whose forward calls `F.scaled_dot_product_attention` and the
keyword of the model's forward that takes token positions. A TorchFunctionMode, active only inside that module,
sends the call to the style's function; a forward pre-hook passes each rank's global positions (for RoPE). The
strategy shards every batch along the sequence with `shard_batch`, in the same order. Models keep no CP code.

Files (lit_mesh/parallel/context/): layout.py (the sequence over the ranks, batches; the cp_style option),
attention.py (the three styles) and kernels.py (their block kernels), rules.py (what CP combines with), this one
(swapping them into a model, applying the plan).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, cast

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from lit_mesh.parallel.context.attention import context_parallel_attention
from lit_mesh.parallel.context.layout import (
    SEQUENCE_DIM,
    ContextParallelError,
    check_cp_style,
    is_load_balanced,
    local_positions,
)
from lit_mesh.plan import ParallelPlan, PlanError

# ---- swapping it into a model ----------------------------------------------------------------------------


def _sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    found = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    found.update(zip(names, args))
    found.update(kwargs)
    return found


class ContextParallelAttention(TorchFunctionMode):
    """Active inside the attention module: its F.scaled_dot_product_attention call becomes the cp style's."""

    def __init__(self, group: dist.ProcessGroup, style: str, where: str) -> None:
        super().__init__()
        self.group, self.style, self.where = group, style, where
        self.calls = 0  # attention calls redirected during the current forward

    @property
    def cp(self) -> int:
        return dist.get_world_size(self.group)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        a = _sdpa_arguments(args, kwargs)
        return self.attend(a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"], a["is_causal"], a["scale"])

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
    ) -> Tensor:
        """The cp style's attention for q, k, v (B, heads, T/cp, head_dim), with SDPA's arguments."""
        if attn_mask is not None:
            raise ContextParallelError(
                f"{self.where} passes attn_mask to scaled_dot_product_attention; context parallel supports"
                " is_causal=True or no mask; express the mask with is_causal, or use cp=1"
            )
        if dropout_p:
            raise ContextParallelError(f"{self.where} uses attention dropout_p={dropout_p}; context parallel needs 0")
        self.calls += 1
        return context_parallel_attention(q, k, v, self.group, self.style, is_causal, scale)


def _swap_attention(module: nn.Module, mode: ContextParallelAttention) -> None:
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        mode.calls = 0
        with mode:
            out = original(*args, **kwargs)
        if mode.calls == 0:  # attention computed some other way would silently see only this rank's shard
            raise ContextParallelError(
                f"{mode.where} ran without calling F.scaled_dot_product_attention, so context parallel cannot make"
                " its attention span the cp ranks; compute attention with F.scaled_dot_product_attention, or use cp=1"
            )
        return out

    module.forward = forward


def _count_calls(module: nn.Module, mode: ContextParallelAttention) -> None:
    """A plan's own swap (ContextPlan.swap) sends `module`'s attention to `mode.attend`: check that every forward
    really did, as _swap_attention does."""

    def reset(_module: nn.Module, _args: tuple) -> None:
        mode.calls = 0

    def check(_module: nn.Module, _args: tuple, _output: Any) -> None:
        if mode.calls == 0:
            raise ContextParallelError(
                f"{mode.where} ran without the context-parallel attention the plan swapped in, so its attention would"
                " see only this rank's shard of the sequence; use cp=1"
            )

    module.register_forward_pre_hook(reset)
    module.register_forward_hook(check)


def _positions_hook(
    keyword: str, cp: int, rank: int, load_balanced: bool, input_shards: int, batched: bool = False
) -> Callable:
    def pass_positions(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get(keyword) is None:
            inputs = args[0] if args else next(v for v in kwargs.values() if isinstance(v, Tensor))  # keyword-only call
            positions = local_positions(
                inputs.shape[SEQUENCE_DIM] * input_shards, cp, rank, load_balanced, inputs.device
            )
            kwargs = {**kwargs, keyword: positions[None] if batched else positions}
        return args, kwargs

    return pass_positions


def cp_plan_problem(plan: ParallelPlan, cp: int, name: str) -> Optional[str]:
    """What `name`'s plan lacks for context parallel over cp ranks (None: nothing): the attention module to swap and
    the keyword of forward() that takes the tokens' global positions."""
    if plan.cp.unavailable:
        return f"cp={cp}: {plan.cp.unavailable}"
    if not plan.cp.attention:
        return (
            f"cp={cp} but {name}.parallel_plan() declares no attention module (ContextPlan.attention);"
            f" context parallel swaps the attention a plan names: declare it, or use cp=1"
        )
    if not plan.cp.positions:
        return (
            f"cp={cp} but {name}.parallel_plan() declares no positions keyword (ContextPlan.positions):"
            " each rank holds tokens from all over the sequence and the model must be told their global positions;"
            " declare the keyword of forward() that takes them, or use cp=1"
        )
    return None


def apply_context_parallel(
    model: nn.Module, plan: ParallelPlan, cp_mesh: DeviceMesh, style: str, entries: Sequence[tuple[nn.Module, int]] = ()
) -> None:
    """Swap the attention of every block for the cp style's and pass this rank's global positions to `model`.

    `entries`: where the inputs come in, if not `model` itself: this rank's pipeline stages, each with the number
    of tp shards its input's sequence is cut into besides cp (tp for a stage after the first under sequence
    parallelism, else 1).
    """
    check_cp_style(style)
    name = type(model).__name__
    attention_name, positions = plan.cp.attention, plan.cp.positions
    problem = cp_plan_problem(plan, cp_mesh.size(), name)  # MeshStrategy refuses it earlier ("cp_fits_plan", rules.py)
    if problem is not None:
        raise PlanError(problem)
    group, rank = cp_mesh.get_group(), cp_mesh.get_local_rank()
    swapped: dict[nn.Module, ContextParallelAttention] = {}
    for index, block in enumerate(cast(nn.ModuleList, model.get_submodule(plan.blocks))):  # a ModuleList
        where = f"{name}.{plan.blocks}.{index}.{attention_name}"
        try:
            attention = block.get_submodule(attention_name)
        except AttributeError:
            raise PlanError(
                f"{name}.parallel_plan() names attention {attention_name!r}, which {where} does not have"
            ) from None
        swapped[attention] = ContextParallelAttention(group, style, where)
    for attention, mode in swapped.items():
        if plan.cp.swap is None:
            _swap_attention(attention, mode)
        else:
            _count_calls(attention, mode)
    if plan.cp.swap is not None:
        plan.cp.swap(model, swapped)
    for entry, input_shards in entries or [(model, 1)]:
        entry.register_forward_pre_hook(
            _positions_hook(
                positions, cp_mesh.size(), rank, is_load_balanced(style), input_shards, plan.cp.positions_batched
            ),
            with_kwargs=True,
        )
