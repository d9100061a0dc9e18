"""A model without a plan (#38): which blocks become FSDP units (lit_mesh/parallel/units.py), and FSDPStrategy's
arguments turned into MeshStrategy's (lit_mesh/parallel/fsdp_arguments.py). One process; the training runs are in
tests/integration/test_own_model.py."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from lit_mesh import MeshStrategy
from lit_mesh.errors import MeshConfigError, PlanError
from lit_mesh.parallel.fsdp_arguments import FSDPArguments, mixed_precision_override, offload_policy
from lit_mesh.parallel.units import choose_blocks, innermost_first, manual_wrap_context, units_report


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)


class Net(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(4, 8)
        self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))  # repeated, but holding fewer parameters
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(8, 4)


def test_the_repeated_children_holding_most_parameters_are_the_blocks() -> None:
    blocks = choose_blocks(Net())
    assert [name for name, _ in blocks.modules] == ["layers.0", "layers.1", "layers.2"]
    assert blocks.describe() == "layers.0-2 (Block)"
    assert (
        units_report(blocks, ["model"], "M")
        == "MeshStrategy: FSDP units (repeated children): layers.0-2 (Block) + 1 more (model)"
    )


def test_nothing_repeats_keeps_one_unit_and_says_so() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Linear(2, 2))  # mixed classes: no blocks
    blocks = choose_blocks(model)
    assert blocks.modules == []
    assert "no repeated blocks found in M" in units_report(blocks, ["model"], "M")


def test_transformers_no_split_modules_name_the_blocks() -> None:
    model = Net()
    model._no_split_modules = ["Block"]  # type: ignore[assignment]
    blocks = choose_blocks(model)
    assert blocks.source == "transformers' _no_split_modules"
    assert [n for n, _ in blocks.modules] == ["layers.0", "layers.1", "layers.2"]


def test_auto_wrap_policy_as_classes_and_as_callable() -> None:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    model = Net()
    assert [n for n, _ in choose_blocks(model, {Block, nn.Embedding}).modules] == [
        "embedding",
        "layers.0",
        "layers.1",
        "layers.2",
    ]
    assert [n for n, _ in choose_blocks(model, ModuleWrapPolicy({Block})).modules] == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]
    # FSDP1's size policy: every module of >= 70 parameters not already covered (the Linear of each Block: 72)
    sized = choose_blocks(model, functools.partial(size_based_auto_wrap_policy, min_num_params=70))
    assert [n for n, _ in sized.modules] == ["layers.0.fc", "layers.1.fc", "layers.2.fc"]
    with pytest.raises(PlanError, match="nn.Module classes"):
        choose_blocks(model, {"Block"})


def test_wrap_in_configure_model_marks_units_innermost_first() -> None:
    from torch.distributed.fsdp.wrap import wrap

    model = Net()
    assert wrap(model.head) is model.head  # outside MeshStrategy's context: nothing
    assert choose_blocks(model).source == "repeated children"
    with manual_wrap_context():
        wrap(model.layers[1])
        wrap(model.layers[1].fc)
    blocks = choose_blocks(model)
    assert blocks.source == "wrap() in configure_model"
    assert innermost_first(blocks) == [model.layers[1].fc, model.layers[1]]
    with manual_wrap_context(), pytest.raises(PlanError, match="per-unit FSDP1 settings"):
        wrap(model.head, cpu_offload=True)


def test_sharding_strategies_and_state_dict_type_take_their_meaning() -> None:
    assert MeshStrategy(sharding_strategy="SHARD_GRAD_OP").options.data.zero_stage == 2
    assert MeshStrategy(sharding_strategy="_HYBRID_SHARD_ZERO2").options.data.zero_stage == 2
    from torch.distributed.fsdp import ShardingStrategy

    assert MeshStrategy(sharding_strategy=ShardingStrategy.NO_SHARD).options.fsdp.sharding_strategy == "NO_SHARD"  # type: ignore[arg-type]
    assert FSDPArguments(sharding_strategy="NO_SHARD").degrees(2, 4) == {"dp_replicate": 8, "dp_shard": 1}
    assert FSDPArguments(sharding_strategy="HYBRID_SHARD").degrees(2, 4) == {"dp_replicate": 2, "dp_shard": 4}
    assert FSDPArguments(device_mesh=(2, 4)).degrees(1, 8) == {"dp_replicate": 2, "dp_shard": 4}
    assert FSDPArguments(sharding_strategy="FULL_SHARD").degrees(2, 4) == {}
    full = MeshStrategy(state_dict_type="full")
    assert full._save_distributed_checkpoint is False and full.options.checkpoint.distributed is False
    with pytest.raises(MeshConfigError, match="sharding_strategy='ZERO_3'"):
        MeshStrategy(sharding_strategy="ZERO_3")
    with pytest.raises(MeshConfigError, match=r"sharding_strategy='SHARD_GRAD_OP' .* and zero_stage=1"):
        MeshStrategy(sharding_strategy="SHARD_GRAD_OP", zero_stage=1)
    with pytest.raises(MeshConfigError, match="zero_stage=2 with pp=2"):  # what it means meets the other rules
        MeshStrategy(sharding_strategy="SHARD_GRAD_OP", pp=2)


def test_fsdp1_keywords_noted_or_refused_with_the_fsdp2_way(caplog: pytest.LogCaptureFixture) -> None:
    MeshStrategy(limit_all_gathers=True, use_orig_params=True, forward_prefetch=True, sync_module_states=True)
    with pytest.raises(MeshConfigError, match="backward_prefetch= is an FSDP1 argument .* set_modules_to_backward"):
        MeshStrategy(backward_prefetch="BACKWARD_PRE")
    with pytest.raises(MeshConfigError, match="param_init_fn= .* reset_parameters"):
        MeshStrategy(param_init_fn=lambda m: None)
    with pytest.raises(TypeError, match=r"unknown MeshStrategy arguments \['not_an_argument'\]"):
        MeshStrategy(not_an_argument=1)
    with pytest.raises(ValueError, match="activation_checkpointing_policy= here"):
        MeshStrategy(activation_checkpointing={Block})  # type: ignore[arg-type]  # FSDPStrategy's deprecated name


def test_offload_and_mixed_precision_policies() -> None:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    assert offload_policy(None) is None and offload_policy(False) is None
    assert isinstance(offload_policy(True), CPUOffloadPolicy)
    assert offload_policy(True, "cpu").pin_memory is False  # type: ignore[union-attr]
    assert isinstance(offload_policy(CPUOffload(offload_params=True)), CPUOffloadPolicy)
    assert offload_policy(CPUOffload(offload_params=False)) is None
    with pytest.raises(MeshConfigError, match="cpu_offload='yes'"):
        MeshStrategy(cpu_offload="yes")
    policy = mixed_precision_override(MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(MeshConfigError, match="device_mesh=\\(2, 0\\)"):
        MeshStrategy(device_mesh=(2, 0))
