"""Activation checkpointing per block: trade recomputation in backward for activation memory.

Uses torch's composable `checkpoint` (no wrapper module), so parameter names, init seeds and checkpoint
keys stay those of the plain model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from lit_mesh.errors import PlanError
from lit_mesh.parallel import expert_counts  # noqa: F401 - registers lit_mesh::exchange_counts (kept below)
from lit_mesh.unit import Facts, Rule, option

ActivationCheckpointing = Literal["none", "full", "selective"]
AC_MODES: tuple[str, ...] = ActivationCheckpointing.__args__  # type: ignore[attr-defined]
OtherBlocksCheckpointing = Literal["none", "selective"]
AC_OTHER_BLOCKS: tuple[str, ...] = OtherBlocksCheckpointing.__args__  # type: ignore[attr-defined]


def _saved_ops() -> set:
    """Ops whose outputs selective checkpointing keeps: matmuls, attention, and the collectives whose output is a
    shard (recomputing them would cost a matmul and communication again). Not the all-gathers: under sequence
    parallel their output is the whole sequence, tp times the shard they recompute from (torchtitan's per-op
    policy keeps none either); `_policy` also leaves out the matmuls whose output is a partial sum."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    candidates = [
        (aten, "mm"),
        (aten, "addmm"),
        (aten, "bmm"),
        (aten, "_scaled_mm"),  # torchao's float8 matmuls (MeshStrategy(float8=...)): recomputing them costs a GEMM
        (aten, "_scaled_dot_product_efficient_attention"),
        (aten, "_scaled_dot_product_flash_attention"),
        (aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (aten, "_scaled_dot_product_cudnn_attention"),
        (aten, "_grouped_mm"),  # the experts' GEMMs
        (c10d, "reduce_scatter_tensor"),
        (c10d, "all_reduce"),
        (c10d, "all_to_all_single"),  # expert parallel's token dispatch and return, Ulysses' head exchange
        (torch.ops.lit_mesh, "exchange_counts"),  # its token counts and their host copy: no collective, no host read
    ]
    return {getattr(ns, name).default for ns, name in candidates if hasattr(ns, name)}


def _ignore_profiler_ranges_in_recompute() -> None:
    """FSDP2's mixed-precision input cast opens a profiler range in the block's pre-forward hook, which runs
    outside the checkpointed region in forward but inside it in recompute; torch's SAC then finds an op it never
    stored. Profiler ranges compute nothing, so SAC may ignore them (SAC_IGNORED_OPS is torch's public list)."""
    profiler = torch.ops.profiler
    for name, overload in (("_record_function_enter_new", "default"), ("_record_function_exit", "_RecordFunction")):
        if hasattr(profiler, name):
            SAC_IGNORED_OPS.add(getattr(getattr(profiler, name), overload))


# where each matmul's contraction dim sits: (index of the left operand, its dim, the right operand's dim)
_CONTRACTIONS = {"mm": (0, 1, 0), "addmm": (1, 1, 0), "bmm": (0, 2, 1), "_scaled_mm": (0, 1, 0)}


def _partial_sum(op, args: tuple) -> bool:  # noqa: ANN001 - an OpOverload
    """A row-parallel matmul: both operands sharded on the contraction dim over one mesh dim, so its output is a
    whole-size partial sum that only its reduce-scatter (kept, a shard) reads."""
    where = _CONTRACTIONS.get(op.overloadpacket.__name__)
    if where is None:
        return False
    left_index, left_dim, right_dim = where
    left, right = args[left_index], args[left_index + 1]
    if not (isinstance(left, DTensor) and isinstance(right, DTensor)):
        return False
    return any(
        isinstance(a, Shard) and isinstance(b, Shard) and a.dim == left_dim and b.dim == right_dim
        for a, b in zip(left.placements, right.placements)
    )


def _policy(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001 - torch's signature
    keep = op in saved and not _partial_sum(op, args)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():  # noqa: ANN202
    _ignore_profiler_ranges_in_recompute()
    return create_selective_checkpoint_contexts(partial(_policy, _saved_ops()))


def check_activation_checkpointing(mode: str, every_n_blocks: int, other_blocks: str = "none") -> None:
    if isinstance(mode, type) or (isinstance(mode, (set, list, tuple)) and all(isinstance(m, type) for m in mode)):
        raise ValueError(
            f"activation_checkpointing={mode!r}: FSDPStrategy's module classes are activation_checkpointing_policy="
            ' here; activation_checkpointing is a mode, one of ("none", "full", "selective")'
        )
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r}; choose one of {AC_MODES}")
    if isinstance(every_n_blocks, bool) or not isinstance(every_n_blocks, int) or every_n_blocks < 1:
        raise ValueError(f"ac_every_n_blocks={every_n_blocks!r} must be an int >= 1 (1: every block)")
    if other_blocks not in AC_OTHER_BLOCKS:
        raise ValueError(f"ac_other_blocks={other_blocks!r}; choose one of {AC_OTHER_BLOCKS}")
    if other_blocks != "none" and (mode != "full" or every_n_blocks == 1):
        raise ValueError(
            f"ac_other_blocks={other_blocks!r} sets the blocks that activation_checkpointing='full' with"
            f" ac_every_n_blocks >= 2 leaves out, but activation_checkpointing={mode!r}, ac_every_n_blocks="
            f"{every_n_blocks} leaves none; use activation_checkpointing='full' with ac_every_n_blocks=2 (or more)"
        )


@dataclass(frozen=True)
class MemoryOptions:
    activation_checkpointing: ActivationCheckpointing = option(
        "none",
        doc='"none", "full" (recompute whole blocks in backward) or "selective" (keep matmul and attention outputs'
        " and the collective results that are shards; recompute the rest, under TP the gathered sequences and the"
        " partial sums too).",
    )
    ac_every_n_blocks: int = option(1, doc="checkpoint every n-th block only (1: all blocks).")
    ac_other_blocks: OtherBlocksCheckpointing = option(
        "none",
        doc='what the blocks that ac_every_n_blocks leaves out of activation_checkpointing="full" do: "none", or'
        ' "selective" (between selective and full in both memory and recompute).',
    )

    def __post_init__(self) -> None:
        check_activation_checkpointing(self.activation_checkpointing, self.ac_every_n_blocks, self.ac_other_blocks)


def block_options(options: Any) -> list[str]:
    """The options given that act on the blocks a plan names (activation checkpointing, compiled blocks)."""
    asked = {
        "activation_checkpointing": options.memory.activation_checkpointing != "none",
        "compile_blocks": options.compile.backend is not None,
    }
    return [name for name, on in asked.items() if on]


def _needs_plan(f: Facts) -> bool:
    return not f.self_parallelised and not f.owners and not f.blocks and bool(block_options(f.options))


RULES: list[Rule] = [
    Rule(
        "block_options_need_plan",
        "setup",
        _needs_plan,
        lambda f: (
            f"{block_options(f.options)[0]} acts on the blocks of a model, but no module of {f.model_name} declares a"
            " parallel_plan() and no repeated blocks were found (an nn.ModuleList / nn.Sequential of same-class"
            " children); name them with auto_wrap_policy={YourBlock}, or declare a plan (see examples/own_model_plan.py)"
        ),
        PlanError,
    ),
]


def checkpoints_block(index: int, every_n_blocks: int) -> bool:
    """Whether the block at `index` of the whole model (0-based) is checkpointed: the n-th, 2n-th, ... block."""
    return (index + 1) % every_n_blocks == 0


def checkpointed_in(start: int, count: int, every_n_blocks: int) -> int:
    """How many of the model's blocks start .. start + count - 1 are checkpointed (a pipeline stage's)."""
    return (start + count) // every_n_blocks - start // every_n_blocks


def apply_activation_checkpointing(
    blocks: Sequence[nn.Module],
    mode: str,
    every_n_blocks: int = 1,
    indices: Sequence[int] | None = None,
    other_blocks: str = "none",
) -> int:
    """Checkpoint every n-th block ("full": recompute the whole block in backward; "selective": keep the
    outputs `_policy` keeps, recompute the rest), and the blocks between those as `other_blocks` says ("none", or
    "selective"). `indices`: each block's index in the whole model (a pipeline stage holds some of them), so the
    same blocks are checkpointed on every layout. Returns how many it wrapped."""
    check_activation_checkpointing(mode, every_n_blocks, other_blocks)
    wrapped = 0
    for index, block in zip(indices if indices is not None else range(len(blocks)), blocks, strict=True):
        block_mode = mode if checkpoints_block(index, every_n_blocks) else other_blocks
        if block_mode == "none":
            continue
        if block_mode == "full":
            checkpoint(block)
        else:
            checkpoint(block, context_fn=_selective_contexts)
        wrapped += 1
    return wrapped


def checkpointed(block: nn.Module) -> bool:
    """True where apply_activation_checkpointing wrapped `block`."""
    return checkpoint.state(block) is not None
