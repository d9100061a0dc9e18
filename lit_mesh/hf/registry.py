"""Which ParallelPlan a transformers model gets: registered by class (or by the user), else derived.

Lookup order for a model: a plan named for this instance (`use_plan`), then the builder registered for its
class or a base class (`register_plan`), then one derived from transformers' own TP plan (FSDP per no-split
layer always; TP where transformers ships a plan we can apply). transformers is never imported here: a model
is a transformers model only if transformers is already loaded and the model is one of its PreTrainedModels.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:  # a type only: transformers is never imported here (see the module docstring)
    from transformers import PreTrainedModel

from torch import nn

from lit_mesh.plan import ParallelPlan

PlanBuilder = Callable[[nn.Module], ParallelPlan]

_BY_CLASS: dict[str, PlanBuilder] = {}
_BY_INSTANCE: weakref.WeakKeyDictionary[nn.Module, PlanBuilder] = weakref.WeakKeyDictionary()


def architectures() -> dict[str, PlanBuilder]:
    """The plan builders by architecture name (imported late: each module may read transformers' classes)."""
    from lit_mesh.hf.decoder import decoder_plan, llama_family_plan
    from lit_mesh.hf.gpt2 import gpt2_plan
    from lit_mesh.hf.mixtral import mixtral_plan, qwen3_moe_plan
    from lit_mesh.hf.vit import vit_plan

    return {
        "decoder": decoder_plan,
        "llama": llama_family_plan,
        "qwen2": llama_family_plan,
        "qwen3": llama_family_plan,  # its q_norm / k_norm over each head: "heads_norm" (lit_mesh/hf/from_config.py)
        "mistral": llama_family_plan,
        "mixtral": mixtral_plan,
        "qwen3_moe": qwen3_moe_plan,
        "gpt2": gpt2_plan,
        "vit": vit_plan,
    }


# transformers classes with a plan of ours (the base models and their task heads)
KNOWN: dict[str, str] = {
    **{
        f"{arch}{task}": arch.lower()
        for arch in ("Llama", "Qwen2", "Qwen3", "Mistral")
        for task in ("Model", "ForCausalLM")
    },
    "MixtralModel": "mixtral",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeModel": "qwen3_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GPT2Model": "gpt2",
    "GPT2LMHeadModel": "gpt2",
    "ViTModel": "vit",
    "ViTForImageClassification": "vit",
}


def _builder(plan: PlanBuilder | str) -> PlanBuilder:
    if callable(plan):
        return plan
    known = architectures()
    if plan not in known:
        raise ValueError(f"unknown architecture {plan!r}; choose one of {sorted(known)} or pass a builder function")
    return known[plan]


def register_plan(model_class: type | str, plan: PlanBuilder | str) -> None:
    """Give every model of `model_class` (a class or its name; subclasses too) the plan `plan`: an architecture
    name ("llama", "gpt2", "vit", ...) or a function model -> lit_mesh.ParallelPlan."""
    _BY_CLASS[model_class if isinstance(model_class, str) else model_class.__name__] = _builder(plan)


def use_plan(model: nn.Module, plan: PlanBuilder | str) -> nn.Module:
    """Name the plan of this one model explicitly (an architecture name or a builder); returns the model."""
    _BY_INSTANCE[model] = _builder(plan)
    return model


def is_transformers_model(module: nn.Module) -> TypeGuard[PreTrainedModel]:
    # the module that defines PreTrainedModel, not transformers' lazy top level: reading the class there imports
    # modeling_utils and every quantizer backend installed (torchao's logs at import) for a model that is no such one
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def plan_for(model: nn.Module) -> ParallelPlan:
    """The ParallelPlan of a transformers model (see the module docstring for the lookup order)."""
    if model in _BY_INSTANCE:
        return _BY_INSTANCE[model](model)
    for cls in type(model).__mro__:
        if cls.__name__ in _BY_CLASS:
            return _BY_CLASS[cls.__name__](model)
        if cls.__name__ in KNOWN:
            return architectures()[KNOWN[cls.__name__]](model)
    from lit_mesh.hf.decoder import derived_plan

    return derived_plan(model)


def declared_plan(module: nn.Module) -> Callable[[], ParallelPlan] | None:
    """The plan source lit_mesh.hf registers (lit_mesh.plan.register_plan_source): the plan of a transformers
    model, None for other modules and for transformers models without blocks to shard (those are handled like
    any module without a plan)."""
    if module in _BY_INSTANCE or (is_transformers_model(module) and _has_blocks(module)):
        return lambda: plan_for(module)
    return None


def _has_blocks(model: nn.Module) -> bool:
    from lit_mesh.hf.blocks import find_blocks

    return find_blocks(model) is not None
