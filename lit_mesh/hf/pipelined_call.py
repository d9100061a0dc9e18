"""The user's own call of a pipelined transformers causal LM: `self.model(input_ids=x, labels=y).loss` under pp.

Inside a step MeshStrategy runs, a call of the whole model runs the pipeline instead of its own forward:
- with `labels` (or `shift_labels`): the schedule over the micro-batches (forward and, in training, backward), and
  the output's `loss` is the batch's loss as transformers computes it (its own `loss_function`: labels shifted
  inside, -100 ignored, the mean over the batch's counted tokens, or over `num_items_in_batch` where given: context
  parallel passes it with its globally shifted labels), on every pp rank, carrying the step's gradients;
- without: forward only, the output's `logits` on every pp rank (validation, prediction); in training that would
  run no backward, so it is refused, naming `lit_mesh.loss_of`.
A stage takes one tensor, so only causal attention without padding: an `attention_mask` is refused (checking it for
padding would read it on the host every step), as is any input besides token ids (`inputs_embeds`, a cache, ...).
A MoE model's router aux loss (Mixtral's `output_router_logits`) is refused with labels: it mixes every layer's
routing over the whole batch, which no stage holds.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from torch import Tensor, nn

from lit_mesh.errors import PipelineConfigError
from lit_mesh.parallel.pipeline.api import is_pipelined, loss_of, microbatches, output_of

# what a call may pass besides the token ids and labels: transformers' own switches that change no number here
_HARMLESS = {"use_cache", "return_dict", "output_attentions", "output_hidden_states", "logits_to_keep"}


def take_calls(model: nn.Module) -> None:
    """Make calls of `model` (a transformers causal LM cut into stages) run its pipeline inside MeshStrategy's steps."""
    model.forward = types.MethodType(_pipelined_forward, model)  # the stages call the class's forward


def _pipelined_forward(
    model: nn.Module,
    input_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
    labels: Tensor | None = None,
    shift_labels: Tensor | None = None,
    num_items_in_batch: Tensor | int | None = None,
    **kwargs: Any,
) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    name = type(model).__name__
    if not is_pipelined(model):
        raise RuntimeError(
            f"{name} is cut into pipeline stages by MeshStrategy (pp > 1): call it inside the LightningModule's"
            " training_step, validation_step, test_step or predict_step while the Trainer runs them"
        )
    router_logits = kwargs.pop("output_router_logits", None)  # a MoE model's (Mixtral): refused with labels below
    given = sorted(key for key, value in kwargs.items() if value is not None and key not in _HARMLESS)
    if input_ids is None or given:
        raise PipelineConfigError(
            f"{name} under pp takes token ids (input_ids) and labels only; got {given or ['no input_ids']}: pipeline"
            " stages pass one tensor between them (no inputs_embeds, cache or other inputs)"
        )
    if attention_mask is not None:  # not read for zeros: that would sync the host every step
        raise PipelineConfigError(
            f"{name} under pp got an attention_mask: pipeline stages use the causal mask alone; pack the sequences"
            " without padding (zoo.TokenDataModule does) and pass no attention_mask, or use pp=1"
        )
    targets = labels if shift_labels is None else shift_labels
    if targets is None:
        if torch.is_grad_enabled() and model.training:
            raise PipelineConfigError(
                f"{name}(input_ids=...) without labels in training under pp: the schedule runs the backward with"
                " the loss, so pass labels (model(input_ids=x, labels=y).loss), or compute your own loss with"
                " lit_mesh.loss_of(self.model, loss_fn, inputs, targets)"
            )
        return CausalLMOutputWithPast(logits=output_of(model, input_ids))
    _refuse_router_aux_loss(model, router_logits)
    # given: the tokens counted over the whole batch where this call sees a part of it (context parallel's shard,
    # lit_mesh/hf/context.py, or the caller's gradient accumulation)
    counted = (
        _counted_tokens(targets, shifted=shift_labels is not None) if num_items_in_batch is None else num_items_in_batch
    )
    n_micro = microbatches(model)

    def loss_fn(logits: Tensor, micro_targets: Tensor) -> Tensor:
        # transformers' own loss over the micro-batch, as a part of the whole batch's mean: the runner averages
        # the micro-batches' losses, so each is its sum over the batch's counted tokens times their number
        loss_function: Any = model.loss_function  # a PreTrainedModel's, by the model's family
        vocab_size = cast(Any, model).config.vocab_size
        if shift_labels is not None:
            part = loss_function(logits, None, vocab_size, num_items_in_batch=counted, shift_labels=micro_targets)
        else:
            part = loss_function(logits, micro_targets, vocab_size, num_items_in_batch=counted)
        return part * n_micro

    return CausalLMOutputWithPast(loss=loss_of(model, loss_fn, input_ids, targets))


def _refuse_router_aux_loss(model: nn.Module, asked: bool | None) -> None:
    """A MoE model whose loss would carry transformers' router aux loss (Mixtral's output_router_logits): it averages
    every layer's routing over the whole batch before multiplying them, which no stage and no micro-batch holds."""
    config = cast(Any, model).config
    on = getattr(config, "output_router_logits", False) if asked is None else asked
    coef = getattr(config, "router_aux_loss_coef", 0.0)
    if on and coef:
        raise PipelineConfigError(
            f"{type(model).__name__} under pp with output_router_logits=True (router_aux_loss_coef={coef}): its"
            " router aux loss averages the routing of every layer over the whole batch, which no pipeline stage and"
            " no micro-batch holds, so the loss would lack it; set the config's output_router_logits=False (or"
            " router_aux_loss_coef=0), or use pp=1"
        )


def _counted_tokens(targets: Tensor, shifted: bool, ignore_index: int = -100) -> Tensor:
    """The tokens transformers' loss counts in the whole batch (labels are shifted inside: the first is dropped)."""
    counted = targets if shifted else targets[..., 1:]
    return (counted != ignore_index).sum()
