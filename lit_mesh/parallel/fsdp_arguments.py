"""Lightning FSDPStrategy's arguments on MeshStrategy, with their FSDP2 meaning: code written for FSDPStrategy (FSDP1)
runs by changing the class name.

    sharding_strategy    FULL_SHARD -> ZeRO-3 (dp_shard = the world), SHARD_GRAD_OP -> ZeRO-2, NO_SHARD -> DDP
                         (dp_replicate = the world), HYBRID_SHARD / _HYBRID_SHARD_ZERO2 -> HSDP: replicas over the
                         nodes, shards inside a node (ZeRO-3 / ZeRO-2)
    device_mesh          (replicas, shards) -> dp_replicate, dp_shard
    auto_wrap_policy     the FSDP units (lit_mesh/parallel/units.py)
    activation_checkpointing_policy   the modules checkpointed (torch's composable checkpoint)
    state_dict_type      "full" -> one file (save_distributed_checkpoint=False), "sharded" -> a directory
    cpu_offload          FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state on the host, the
                         optimizer step on the CPU
    mixed_precision      FSDP1's MixedPrecision -> FSDP2's MixedPrecisionPolicy (or a MixedPrecisionPolicy as is)
    **kwargs (FSDP1's)   harmless ones noted once and dropped, the rest refused with the FSDP2 way (FSDP1_KEYWORDS)

Each is exclusive with lit-mesh's own name for the same thing (RULES).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lit_mesh.errors import MeshConfigError
from lit_mesh.unit import Facts, Rule, option

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_ZERO_STAGE = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 3, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2}
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")

# FSDP1 keyword arguments FSDPStrategy hands to FullyShardedDataParallel: None = harmless under FSDP2 (noted once,
# dropped), else the FSDP2 way to say it
FSDP1_KEYWORDS: dict[str, Optional[str]] = {
    "limit_all_gathers": None,  # FSDP2 limits in-flight all-gathers itself
    "use_orig_params": None,  # FSDP2 always keeps the original parameters (DTensors)
    "forward_prefetch": None,  # FSDP2 prefetches the next unit's all-gather by itself
    "sync_module_states": None,  # MeshStrategy initialises every rank's shards from one seed (lit_mesh/init.py)
    "backward_prefetch": "FSDP2 prefetches the next unit in backward by itself (for explicit control, call"
    " set_modules_to_backward_prefetch on the FSDP modules in configure_model after fully_shard)",
    "ignored_modules": "FSDP2's fully_shard(..., ignored_params=...): apply fully_shard yourself in configure_model",
    "ignored_states": "FSDP2's fully_shard(..., ignored_params=...): apply fully_shard yourself in configure_model",
    "param_init_fn": "build the model in configure_model (on the meta device): MeshStrategy materialises each rank's"
    " shards and initialises them with reset_parameters() (lit_mesh/init.py)",
    "device_id": "the Trainer's devices= places each rank on its device",
    "process_group": "give the data-parallel layout with dp / dp_replicate / dp_shard, or device_mesh=(replicas, shards)",
}

ShardingStrategyName = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]


@dataclass(frozen=True)
class FSDPArguments:
    """FSDPStrategy's arguments as given (None: not given); their meaning is in the module's doc."""

    auto_wrap_policy: Optional[Any] = option(
        None,
        doc="FSDPStrategy's name: the modules that become FSDP2 units, a set of nn.Module classes (e.g. {Block}) or a"
        " torch wrap policy / callable(module, recurse, nonwrapped_numel), for a model without a parallel_plan()."
        " Default: the repeated blocks found (the nn.ModuleList / nn.Sequential of same-class children holding the"
        " most parameters, or transformers' _no_split_modules).",
    )
    activation_checkpointing_policy: Optional[Any] = option(
        None,
        doc="FSDPStrategy's name: the modules whose activations are recomputed in backward (a set of nn.Module classes"
        ' or a policy, as auto_wrap_policy); not together with activation_checkpointing="full"/"selective".',
    )
    sharding_strategy: Optional[str] = option(
        None,
        doc="FSDPStrategy's name: FULL_SHARD (ZeRO-3 over all ranks), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP),"
        " HYBRID_SHARD / _HYBRID_SHARD_ZERO2 (HSDP: replicas over the nodes, shards inside a node); a string or"
        " torch's ShardingStrategy. Not together with dp, dp_replicate, dp_shard or zero_stage.",
    )
    state_dict_type: Optional[Literal["full", "sharded"]] = option(
        None,
        doc='FSDPStrategy\'s name: "sharded" (a directory, one file per rank) or "full" (one file); the same as'
        " save_distributed_checkpoint=True / False.",
    )
    cpu_offload: Optional[Any] = option(
        None,
        doc="FSDPStrategy's name: True (or FSDP2's CPUOffloadPolicy, FSDP1's CPUOffload(offload_params=True)) keeps"
        " parameters, gradients and optimizer state on the host and runs the optimizer step on the CPU.",
    )
    mixed_precision: Optional[Any] = option(
        None,
        doc="FSDPStrategy's name: FSDP1's MixedPrecision(param_dtype, reduce_dtype) or FSDP2's MixedPrecisionPolicy,"
        " used for every FSDP unit in place of the one the Trainer's precision implies.",
    )
    device_mesh: Optional[tuple[int, int]] = option(
        None,
        doc="FSDPStrategy's name: (replicas, shards) for HSDP, i.e. dp_replicate=replicas, dp_shard=shards.",
    )

    def __post_init__(self) -> None:
        name = getattr(self.sharding_strategy, "name", self.sharding_strategy)  # torch's ShardingStrategy enum
        if name is not None and name not in SHARDING_STRATEGIES:
            raise MeshConfigError(f"sharding_strategy={self.sharding_strategy!r}; choose one of {SHARDING_STRATEGIES}")
        object.__setattr__(self, "sharding_strategy", name)
        if self.state_dict_type not in (None, "full", "sharded"):
            raise MeshConfigError(f'state_dict_type={self.state_dict_type!r}; choose "full" or "sharded"')
        if self.device_mesh is not None:
            if type(self.device_mesh).__name__ == "DeviceMesh":
                raise MeshConfigError(
                    "device_mesh: MeshStrategy builds the one DeviceMesh of the run; give its shape as a tuple"
                    " (replicas, shards), or dp_replicate= and dp_shard="
                )
            shape = tuple(self.device_mesh)
            if len(shape) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
                raise MeshConfigError(
                    f"device_mesh={self.device_mesh!r} must be a tuple (replicas, shards) of ints >= 1"
                )
            object.__setattr__(self, "device_mesh", shape)
        offload_policy(self.cpu_offload)  # what it cannot mean fails here, in the user's process
        mixed_precision_override(self.mixed_precision)

    def degrees(self, nodes: int, devices_per_node: int) -> dict[str, int]:
        """The data-parallel degrees sharding_strategy / device_mesh mean, once nodes and devices are known."""
        if self.device_mesh is not None:
            return {"dp_replicate": self.device_mesh[0], "dp_shard": self.device_mesh[1]}
        if self.sharding_strategy == "NO_SHARD":
            return {"dp_replicate": nodes * devices_per_node, "dp_shard": 1}
        if self.sharding_strategy in HYBRID:
            return {"dp_replicate": nodes, "dp_shard": devices_per_node}
        return {}


def offload_policy(cpu_offload: Any, device_type: str = "cuda") -> Optional[OffloadPolicy]:
    """FSDP2's offload policy for FSDPStrategy's cpu_offload (None: parameters stay on the device). Host memory is
    pinned for the copies to an accelerator; with CPU ranks there is nothing to pin for (and torch cannot)."""
    if cpu_offload is None or cpu_offload is False:
        return None
    if cpu_offload is True:
        return CPUOffloadPolicy(pin_memory=device_type != "cpu")
    if isinstance(cpu_offload, OffloadPolicy):
        return cpu_offload
    if hasattr(cpu_offload, "offload_params"):  # FSDP1's CPUOffload
        return CPUOffloadPolicy(pin_memory=device_type != "cpu") if cpu_offload.offload_params else None
    raise MeshConfigError(
        f"cpu_offload={cpu_offload!r}; give True, torch.distributed.fsdp.CPUOffloadPolicy() or FSDP1's"
        " CPUOffload(offload_params=True)"
    )


def mixed_precision_override(mixed_precision: Any) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's policy for FSDPStrategy's mixed_precision (None: the Trainer's precision decides)."""
    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if hasattr(mixed_precision, "param_dtype") and hasattr(mixed_precision, "reduce_dtype"):  # FSDP1's MixedPrecision
        dtypes = (mixed_precision.param_dtype, mixed_precision.reduce_dtype)
        if not all(d is None or isinstance(d, torch.dtype) for d in dtypes):
            raise MeshConfigError(f"mixed_precision={mixed_precision!r}: param_dtype and reduce_dtype are torch dtypes")
        # FSDP2 keeps buffers in their dtype (FSDP1's buffer_dtype has no counterpart)
        return MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])
    raise MeshConfigError(
        f"mixed_precision={mixed_precision!r}; give torch.distributed.fsdp.MixedPrecisionPolicy(...) or FSDP1's"
        " MixedPrecision(param_dtype=..., reduce_dtype=...)"
    )


_NOTED: set[str] = set()


def check_fsdp1_keywords(given: dict[str, Any]) -> None:
    """FSDPStrategy's **kwargs (FSDP1's own arguments): harmless ones noted once, the rest refused with the FSDP2
    way; anything else is unknown to both strategies."""
    for name in given:
        if name not in FSDP1_KEYWORDS:
            continue
        way = FSDP1_KEYWORDS[name]
        if way is not None:
            raise MeshConfigError(f"{name}= is an FSDP1 argument with no counterpart in FSDP2: {way}")
        if name not in _NOTED:
            _NOTED.add(name)
            rank_zero_info(f"MeshStrategy: {name}={given[name]!r} is an FSDP1 setting; FSDP2 needs none, it is ignored")


def resolve(options: Any) -> Any:
    """MeshOptions with FSDPStrategy's names turned into lit-mesh's (zero_stage, save_distributed_checkpoint); the
    degrees they imply wait for the world size (FSDPArguments.degrees)."""
    fsdp: FSDPArguments = options.fsdp
    if fsdp.sharding_strategy is not None:
        options = replace(options, data=replace(options.data, zero_stage=_ZERO_STAGE[fsdp.sharding_strategy]))
    if fsdp.state_dict_type is not None:
        distributed = fsdp.state_dict_type == "sharded"
        options = replace(options, checkpoint=replace(options.checkpoint, distributed=distributed))
    return options


def _dp_names_given(f: Facts) -> list[str]:
    names = ("dp", "dp_replicate", "dp_shard", "data_parallel_size")
    given = [f"{n}={getattr(f.options.mesh, n)!r}" for n in names if getattr(f.options.mesh, n) is not None]
    return given + ([f"zero_stage={f.options.data.zero_stage}"] if f.options.data.zero_stage != 3 else [])


RULES: list[Rule] = [
    Rule(
        "sharding_strategy_or_dp_names",
        "init",
        lambda f: f.options.fsdp.sharding_strategy is not None and bool(_dp_names_given(f)),
        lambda f: (
            f"sharding_strategy={f.options.fsdp.sharding_strategy!r} (FSDPStrategy's name) and"
            f" {', '.join(_dp_names_given(f))} (MeshStrategy's) both say how data parallelism shards; give one:"
            " FULL_SHARD = dp_shard over all ranks, SHARD_GRAD_OP = zero_stage=2, NO_SHARD = dp_replicate over all"
            " ranks, HYBRID_SHARD = dp_replicate=nodes with dp_shard=devices per node"
        ),
    ),
    Rule(
        "device_mesh_or_dp_names",
        "init",
        lambda f: (
            f.options.fsdp.device_mesh is not None
            and (
                any(
                    getattr(f.options.mesh, n) is not None
                    for n in ("dp", "dp_replicate", "dp_shard", "data_parallel_size")
                )
                or f.options.fsdp.sharding_strategy not in (None, *HYBRID)
            )
        ),
        lambda f: (
            f"device_mesh={f.options.fsdp.device_mesh} means dp_replicate={f.options.fsdp.device_mesh[0]},"
            f" dp_shard={f.options.fsdp.device_mesh[1]} (HSDP); do not give "
            + ", ".join(
                [
                    f"{n}="
                    for n in ("dp", "dp_replicate", "dp_shard", "data_parallel_size")
                    if getattr(f.options.mesh, n) is not None
                ]
                + (
                    [f"sharding_strategy={f.options.fsdp.sharding_strategy!r}"]
                    if f.options.fsdp.sharding_strategy
                    else []
                )
            )
            + " as well (device_mesh goes with a HYBRID sharding_strategy or alone)"
        ),
    ),
    Rule(
        "activation_checkpointing_policy_or_mode",
        "init",
        lambda f: (
            f.options.fsdp.activation_checkpointing_policy is not None
            and f.options.memory.activation_checkpointing != "none"
        ),
        lambda f: (
            f"activation_checkpointing_policy (FSDPStrategy's name) and"
            f" activation_checkpointing={f.options.memory.activation_checkpointing!r} (MeshStrategy's) both choose"
            " what is checkpointed; give one: the policy checkpoints the modules it names, the mode checkpoints the"
            " blocks (every ac_every_n_blocks-th)"
        ),
    ),
    Rule(
        "state_dict_type_or_save_distributed_checkpoint",
        "init",
        lambda f: f.options.fsdp.state_dict_type is not None and not f.options.checkpoint.distributed,
        lambda f: (
            f"state_dict_type={f.options.fsdp.state_dict_type!r} (FSDPStrategy's name) and"
            " save_distributed_checkpoint=False (MeshStrategy's) both choose the checkpoint format; give one"
            ' (state_dict_type="full" is save_distributed_checkpoint=False)'
        ),
    ),
    Rule(
        "wrap_policies_without_plan",
        "setup",
        lambda f: (
            bool(f.owners)
            and (
                f.options.fsdp.auto_wrap_policy is not None
                or f.options.fsdp.activation_checkpointing_policy is not None
            )
        ),
        lambda f: (
            f"auto_wrap_policy / activation_checkpointing_policy choose the units of a model without a plan, but"
            f" {f.owners[0].name} of {f.model_name} declares a parallel_plan() whose blocks are the units; drop the"
            " policies (use activation_checkpointing= for the plan's blocks), or remove the plan"
        ),
    ),
    Rule(
        "wrap_policies_with_own_parallelism",
        "setup",
        lambda f: (
            f.self_parallelised
            and (
                f.options.fsdp.auto_wrap_policy is not None
                or f.options.fsdp.activation_checkpointing_policy is not None
                or f.options.fsdp.cpu_offload not in (None, False)
                or f.options.fsdp.mixed_precision is not None
            )
        ),
        lambda f: (
            f"configure_model of {f.model_name} applied fully_shard (or DTensors) itself, so MeshStrategy applies no"
            " FSDP settings; pass auto_wrap_policy, activation_checkpointing_policy, cpu_offload and mixed_precision"
            " to your own fully_shard / checkpoint calls, or let MeshStrategy shard the model"
        ),
    ),
    Rule(
        "cpu_offload_needs_fsdp",
        "launch",
        lambda f: (
            offload_policy(f.options.fsdp.cpu_offload) is not None
            and (f.layout.data_parallel == "none" or f.options.tensor.mode != "1d")
        ),
        lambda f: (
            f"cpu_offload keeps the FSDP units' parameters on the host, but this layout ({f.layout.describe()}) applies"
            " no FSDP: give more than one data-parallel rank"
            + (" and tp_mode='1d'" if f.options.tensor.mode != "1d" else "")
            + ", or drop cpu_offload"
        ),
    ),
]
