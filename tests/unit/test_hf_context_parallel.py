"""Context parallel for transformers decoders in one process (lit_mesh/hf/context.py): which families get it, and what
it refuses with the fix, at setup (an attention implementation it cannot shard, a family without it) and at the call
(a padding mask, a sliding window shorter than the sequence), before any collective. Parity across ranks:
tests/integration/test_hf.py (the cp runs)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from lit_mesh.errors import ContextParallelError, PlanError
from lit_mesh.hf import plan_for
from lit_mesh.hf.context import ATTENTION
from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.options import MeshOptions
from lit_mesh.parallel.context import apply_context_parallel
from lit_mesh.parallel.context import rules as context_rules
from lit_mesh.plan import PlanOwner
from lit_mesh.rules import check
from lit_mesh.unit import Facts
from zoo.hf import tiny_config

pytest.importorskip("transformers")


def _model(architecture: str, **overrides: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(architecture, **overrides))


def _setup_check(model: torch.nn.Module) -> None:
    """The context-parallel unit's setup rules for cp=2, with `model` as the only plan owner."""
    owner = PlanOwner("model", model, plan_for(model))
    facts = Facts(layout=MeshLayout(cp=2), model_name="Net", owners=[owner])
    check("setup", facts, only=tuple(rule.name for rule in context_rules.RULES if rule.phase == "setup"))


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral"])
def test_llama_family_declares_context_parallel_through_the_registry(architecture: str) -> None:
    model = _model(architecture)
    cp = plan_for(model).cp
    assert (cp.attention, cp.positions, cp.positions_batched, cp.unavailable) == ("self_attn", "position_ids", True, "")
    assert cp.swap is not None
    _setup_check(model)  # nothing refused


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_attention_it_cannot_shard_is_refused_at_setup_by_name(implementation: str) -> None:
    model = _model("llama")
    model.config._attn_implementation = implementation  # as from_pretrained(..., attn_implementation=...) leaves it
    with pytest.raises(PlanError) as refused:
        _setup_check(model)
    message = str(refused.value)
    assert f"cp=2: LlamaForCausalLM computes attention with attn_implementation={implementation!r}" in message
    assert "attn_implementation='sdpa', or use cp=1" in message


@pytest.mark.parametrize("architecture", ["gpt2", "mixtral", "opt"])
def test_families_without_context_parallel_are_refused_by_name(architecture: str) -> None:
    model = _model(architecture)
    with pytest.raises(PlanError, match=r"context parallel is offered for the transformers families Llama, Qwen2,"):
        _setup_check(model)


@pytest.fixture
def cp2() -> Iterator[object]:
    """A cp mesh of 2 fake ranks: everything up to the first collective runs in this process."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield build_device_mesh(MeshLayout(cp=2), "cpu")["cp"]
    finally:
        dist.destroy_process_group()


def _with_cp(model: torch.nn.Module, cp_mesh: object) -> torch.nn.Module:
    apply_context_parallel(model, plan_for(model), cp_mesh, "ring")  # type: ignore[arg-type]
    assert model.config._attn_implementation == ATTENTION
    return model


def test_padding_mask_is_refused_at_the_call(cp2: object) -> None:
    model = _with_cp(_model("llama"), cp2)
    tokens = torch.randint(0, 256, (2, 8))
    with pytest.raises(ContextParallelError) as refused:
        model(input_ids=tokens, attention_mask=torch.ones_like(tokens))  # transformers would drop even this one
    with pytest.raises(ContextParallelError, match="self_attn got an attention mask"):  # the base model: no hook
        model.model(input_ids=tokens, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool))
    message = str(refused.value)
    assert "LlamaForCausalLM(attention_mask=...) got an attention mask" in message
    assert "pass no attention_mask, or use cp=1" in message


def test_sliding_window_shorter_than_the_sequence_is_refused(cp2: object) -> None:
    model = _with_cp(_model("mistral", sliding_window=8), cp2)
    with pytest.raises(ContextParallelError) as refused:
        model(input_ids=torch.randint(0, 256, (2, 8)))  # 8 tokens here, 16 over the two cp ranks
    message = str(refused.value)
    assert "self_attn attends over a sliding window of 8 tokens, shorter than the sequence (16)" in message
    assert "sequences of at most 8 tokens, a config with sliding_window=None, or cp=1" in message


def test_attention_outside_mesh_strategy_is_refused() -> None:
    from lit_mesh.hf.context import context_parallel_attention

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ContextParallelError, match="which only MeshStrategy's context parallel sets up"):
        context_parallel_attention(torch.nn.Linear(1, 1), q, q, q, None)


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
def test_pipeline_with_context_parallel_is_refused_only_for_families_without_it(architecture: str) -> None:
    """pp2 x cp2: every setup rule passes a Llama (its stages take cp's positions); GPT-2 is refused by CP's name."""
    model = _model(architecture)
    owner = PlanOwner("model", model, plan_for(model))
    facts = Facts(options=MeshOptions(), layout=MeshLayout(pp=2, cp=2), model_name="Net", owners=[owner])
    if architecture == "llama":
        check("setup", facts)
    else:
        with pytest.raises(PlanError, match=r"cp=2: context parallel is offered for the transformers families"):
            check("setup", facts)
