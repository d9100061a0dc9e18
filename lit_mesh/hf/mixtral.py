"""Mixtral (MixtralModel, MixtralForCausalLM) and Qwen3-MoE (Qwen3MoeModel, Qwen3MoeForCausalLM, every layer MoE): FSDP
per decoder layer and per layer's experts, TP of the attention from transformers' own plan (+SP; Qwen3's q/k norms
over each head: "heads_norm"), expert parallel over `ep`, expert tensor parallel over `tp`. The two MoE blocks have
the same parts (a top-k router returning (logits, weights, expert ids), experts stacked as gate_up_proj and
down_proj); Qwen3-MoE's router renormalises the chosen weights only where norm_topk_prob says so, as transformers'.

transformers' plan also splits each expert's width over tp (packed_colwise / moe_tp_experts styles); lit-mesh
does so as for the zoo MoE instead: the MoE block runs on the whole sequence, replicated over tp
("whole_sequence"), and expert parallel splits each expert's width over tp (`MoEPlan.hidden_dims`; gate_up_proj
stacks [gate; up], so each tp rank takes its slice of both).

Expert parallel needs an MoE layer that sends grouped tokens through a `dispatcher` to `experts(tokens,
tokens_per_expert)` (lit_mesh/parallel/expert.py). transformers' MixtralSparseMoeBlock loops over its experts
itself, so the plan's MoE adapter swaps the classes of the block and its experts for subclasses that do
(as FSDP2 swaps a module's class; parameters, names and transformers' initialisation stay): the router is
transformers' own (softmax over all experts, top-k renormalised), only the expert computation is regrouped.
It is applied on every layout, single device included, so all layouts compute alike.

Under pp, MixtralForCausalLM is cut as Llama is (lit_mesh/hf/pipeline.py), each stage's MoE blocks dispatching over
ep. transformers' router aux loss (`output_router_logits`) averages the routing of every layer over the whole
batch before it multiplies them: no stage holds it, nor any micro-batch, so it is refused under pp
(lit_mesh/hf/pipelined_call.py); without it the model adds no balancing loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lit_mesh.hf.blocks import hf_config
from lit_mesh.hf.decoder import tp_divides, with_decoder_stages
from lit_mesh.hf.from_config import hf_tp_plan, plan_from_hf
from lit_mesh.parallel.expert_combine import weighted_sum_per_token
from lit_mesh.plan import MoEPlan, ParallelPlan, PlanError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    # expert weights are DTensors sharded over ep; router outputs DTensors replicated over tp
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class LocalDispatch:
    """All experts on this device (expert parallel swaps in lit_mesh.parallel.expert.AllToAllDispatch)."""

    def global_load(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return tokens_per_expert

    def combine(
        self,
        experts: nn.Module,
        tokens: torch.Tensor,
        token_index: torch.Tensor,
        weights: torch.Tensor,
        tokens_per_expert: torch.Tensor,
    ) -> torch.Tensor:
        """Each token's weighted sum of its experts' outputs (as zoo.moe.LocalDispatch)."""
        return weighted_sum_per_token(tokens, token_index, experts(tokens[token_index], tokens_per_expert), weights)


class GroupedExperts(nn.Module):
    """Mixed into transformers' MixtralExperts: tokens already grouped by expert, this rank's experts."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        if tokens_per_expert.shape[0] != gate_up.shape[0]:
            raise ValueError(f"{tokens_per_expert.shape[0]} token groups for {gate_up.shape[0]} experts")
        outputs = []
        # a loop over the experts: its split sizes are host integers (one host read)
        for x, w_gate_up, w_down in zip(tokens.split(tokens_per_expert.tolist()), gate_up, down):
            gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)  # transformers' [gate; up] layout
            outputs.append(F.linear(self.act_fn(gate) * up, w_down))
        return torch.cat(outputs) if outputs else tokens[:0]


class _Router(Protocol):
    """transformers' MixtralTopKRouter: (logits, top-k weights, top-k expert ids) of the tokens."""

    num_experts: int

    def __call__(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class DispatchedMoE(nn.Module):
    """Mixed into transformers' MixtralSparseMoeBlock: route with its router, then group the (token, expert)
    assignments by expert and hand them to `dispatcher` (the zoo MoE's scheme, zoo/moe.py)."""

    dispatcher: LocalDispatch
    gate: _Router
    experts: nn.Module

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        B, T, D = hidden_states.shape
        jitter_noise = getattr(self, "jitter_noise", 0.0)  # Mixtral's; Qwen3-MoE has none
        if self.training and jitter_noise > 0:  # as transformers does (drawn per rank)
            noise = torch.empty_like(hidden_states).uniform_(1 - jitter_noise, 1 + jitter_noise)
            hidden_states = hidden_states * noise
        tokens = hidden_states.reshape(B * T, D)
        _, weights, expert_ids = (_local(t) for t in self.gate(tokens))  # the router's own call (output recording)
        n_experts, k = self.gate.num_experts, expert_ids.shape[1]
        token_index = torch.arange(B * T, device=tokens.device).repeat_interleave(k)
        order = torch.argsort(expert_ids.flatten(), stable=True)
        token_index, weights = token_index[order], weights.flatten()[order]
        tokens_per_expert = torch.bincount(expert_ids.flatten(), minlength=n_experts)
        mixed = self.dispatcher.combine(self.experts, tokens, token_index, weights, tokens_per_expert)
        return mixed.view(B, T, D)


def _swap_class(module: nn.Module, mixin: type) -> None:
    if not isinstance(module, mixin):
        cls = type(module)
        module.__class__ = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})


def dispatch_experts(moe: nn.Module) -> None:
    """The plan's MoE adapter: make a MixtralSparseMoeBlock route through a dispatcher (idempotent)."""
    _swap_class(moe.get_submodule("experts"), GroupedExperts)
    _swap_class(moe, DispatchedMoE)
    if not hasattr(moe, "dispatcher"):
        cast(DispatchedMoE, moe).dispatcher = LocalDispatch()  # its class is DispatchedMoE's subclass now


def qwen3_moe_plan(model: nn.Module) -> ParallelPlan:
    """Qwen3-MoE with every layer MoE; dense layers (decoder_sparse_step > 1, mlp_only_layers) refused by name."""
    config = hf_config(model)
    if config.decoder_sparse_step != 1 or config.mlp_only_layers:
        raise PlanError(
            f"{type(model).__name__} with decoder_sparse_step={config.decoder_sparse_step}, mlp_only_layers="
            f"{config.mlp_only_layers} mixes dense and MoE layers, which lit-mesh's plan for it does not split;"
            " build it with decoder_sparse_step=1 and mlp_only_layers=[], or give it a plan of your own"
            " (lit_mesh.hf.register_plan)"
        )
    plan = mixtral_plan(model)
    # tp splits the experts' width (moe_intermediate_size); intermediate_size sizes dense layers it has none of
    divides = {k: v for k, v in plan.tp.divides.items() if k != "intermediate_size"}
    divides["moe_intermediate_size"] = config.moe_intermediate_size
    return dataclasses.replace(plan, tp=dataclasses.replace(plan.tp, divides=divides))


def mixtral_plan(model: nn.Module) -> ParallelPlan:
    config = hf_config(model)
    # transformers' plan without its expert entries (see the module docstring)
    attention_only = {key: style for key, style in hf_tp_plan(model).items() if ".mlp." not in f"{key}."}
    plan = plan_from_hf(model, tp_divides(model), attention_only)  # intermediate_size: the experts' width
    plan = with_decoder_stages(model, plan)  # MixtralForCausalLM: Llama's stages, the dispatchers inside them
    return dataclasses.replace(
        plan,
        tp=dataclasses.replace(plan.tp, block={**plan.tp.block, "mlp": "whole_sequence"}),
        moe=MoEPlan(
            layer="mlp",
            ep_divides={"num_local_experts": config.num_local_experts},
            adapter=dispatch_experts,
            hidden_dims={"gate_up_proj": 1, "down_proj": 2},
            packed=("gate_up_proj",),
            # transformers' router aux loss mixes every layer's routing over the whole batch: refused under pp
            balancing_under_pp=False,
        ),
    )
