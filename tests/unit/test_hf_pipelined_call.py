"""The user's own call of a transformers causal LM under pp (lit_mesh/hf/pipelined_call.py): what it refuses, by
name, before any pipeline runs. Its runs across ranks: tests/integration/test_hf.py (examples/hf_pipeline.py)."""

from __future__ import annotations

import pytest
import torch

from lit_mesh.errors import PipelineConfigError
from lit_mesh.hf import pipelined_call
from lit_mesh.hf.pipelined_call import take_calls

transformers = pytest.importorskip("transformers")


@pytest.fixture
def model(monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM(config)
    take_calls(model)
    monkeypatch.setattr(pipelined_call, "is_pipelined", lambda _model: True)  # as inside a step under pp
    return model


TOKENS = torch.zeros(2, 8, dtype=torch.long)


@pytest.mark.parametrize("padded", [True, False])
def test_an_attention_mask_is_refused_by_name(model: torch.nn.Module, padded: bool) -> None:
    """With padding or without (all ones): telling them apart would read the mask on the host every step."""
    mask = torch.ones(2, 8, dtype=torch.long)
    if padded:
        mask[0, -2:] = 0
    with pytest.raises(PipelineConfigError, match="got an attention_mask: pipeline stages use the causal mask alone"):
        model(input_ids=TOKENS, attention_mask=mask, labels=TOKENS)


def test_other_inputs_are_refused_by_name(model: torch.nn.Module) -> None:
    with pytest.raises(
        PipelineConfigError, match=r"takes token ids \(input_ids\) and labels only; got \['inputs_embeds'\]"
    ):
        model(inputs_embeds=torch.zeros(2, 8, 16), labels=TOKENS)


def test_logits_in_training_name_loss_of(model: torch.nn.Module) -> None:
    model.train()
    with pytest.raises(PipelineConfigError, match="lit_mesh.loss_of"):
        model(input_ids=TOKENS)


def test_outside_a_step_is_refused(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipelined_call, "is_pipelined", lambda _model: False)
    with pytest.raises(RuntimeError, match="cut into pipeline stages"):
        model(input_ids=TOKENS, labels=TOKENS)


@pytest.mark.parametrize("in_config", [True, False])
def test_a_router_aux_loss_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, in_config: bool) -> None:
    """Mixtral's router aux loss mixes every layer's routing over the whole batch, which no stage holds: asked for
    in the config or in the call, with labels, it is refused; with the config's coefficient 0 it changes no number."""
    from zoo.hf import tiny_config

    model = transformers.MixtralForCausalLM(tiny_config("mixtral", output_router_logits=in_config))
    take_calls(model)
    monkeypatch.setattr(pipelined_call, "is_pipelined", lambda _model: True)
    asked = {} if in_config else {"output_router_logits": True}
    with pytest.raises(PipelineConfigError, match=r"output_router_logits=True \(router_aux_loss_coef=0.001\)"):
        model(input_ids=TOKENS, labels=TOKENS, **asked)
    model.config.router_aux_loss_coef = 0.0  # no aux term in the loss: on to the pipeline's loss
    monkeypatch.setattr(pipelined_call, "loss_of", lambda *_args: torch.tensor(1.5))
    assert model(input_ids=TOKENS, labels=TOKENS, **asked).loss.item() == 1.5
