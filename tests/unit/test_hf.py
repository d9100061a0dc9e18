"""Zoo <-> transformers conversions (the same logits both ways; mismatches and unsupported routing refused by
name) and the plan registry for transformers models, in one process. Layout parity and exports across ranks:
tests/integration/test_hf.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

MIXTRAL = "--model.init_args.architecture=mixtral"


# ---- in this process: conversions and plan selection ------------------------------------------------------


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_zoo_gpt_and_llama_give_the_same_logits_both_ways(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoo import GPT, GPTConfig
    from zoo.convert import hf_to_zoo, load_hf_as_zoo, save_hf, zoo_to_hf

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 24))
    gpt = GPT(GPTConfig.from_preset("tiny")).eval()
    with torch.no_grad():
        assert _max_diff(zoo_to_hf(gpt)(input_ids=tokens).logits, gpt(tokens)) <= 1e-5
        llama = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=8,
                num_key_value_heads=2,
            )
        ).eval()
        assert _max_diff(hf_to_zoo(llama)(tokens), llama(input_ids=tokens).logits) <= 1e-5
        # through a transformers directory (config.json + safetensors), both ways
        save_hf(gpt, tmp_path / "llama")
        assert (
            _max_diff(LlamaForCausalLM.from_pretrained(tmp_path / "llama")(input_ids=tokens).logits, gpt(tokens))
            <= 1e-5
        )
        assert _max_diff(load_hf_as_zoo(tmp_path / "llama")(tokens), gpt(tokens)) <= 1e-5
        # the check can fail: another weight gives other logits
        other = zoo_to_hf(gpt)
        other.model.layers[0].mlp.up_proj.weight.mul_(1.01)
        assert _max_diff(other(input_ids=tokens).logits, gpt(tokens)) > 1e-5


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_heads_of_another_width_convert_both_ways(tmp_path: Path, architecture: str) -> None:
    """head_dim set where n_heads x head_dim is not dim (Qwen3, Mistral-Nemo): wq and wo are not square, and the
    width reaches transformers' config and comes back."""
    from zoo import GPT, GPTConfig
    from zoo.convert import load_hf_as_zoo, save_hf, zoo_to_hf
    from zoo.moe import MoEConfig, MoETransformer

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 24))
    model = (
        GPT(GPTConfig.from_preset("tiny", head_dim=32))
        if architecture == "llama"
        else MoETransformer(MoEConfig.from_preset("tiny", head_dim=32))
    ).eval()
    assert model.layers[0].attention.wq.weight.shape == (4 * 32, 64)
    with torch.no_grad():
        hf = zoo_to_hf(model)
        assert hf.config.head_dim == 32
        assert _max_diff(hf(input_ids=tokens).logits, model(tokens)) <= 1e-5
        save_hf(model, tmp_path / architecture)
        back = load_hf_as_zoo(tmp_path / architecture)
        assert back.config.head_dim == 32 and back.config.attention_head_dim == 32
        assert _max_diff(back(tokens), model(tokens)) <= 1e-5


def test_a_head_width_of_dim_over_heads_stays_implicit() -> None:
    """A transformers head_dim equal to hidden_size / heads maps to the zoo's default (None), so presets and
    converted configs compare equal and a later change of dim keeps heads of dim / n_heads."""
    from transformers import LlamaConfig

    from zoo.convert.llama import to_gpt_config

    c = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    assert c.head_dim == 16 and to_gpt_config(c).head_dim is None
    assert to_gpt_config(LlamaConfig(**{**c.to_dict(), "head_dim": 8})).head_dim == 8


def test_tied_zoo_gpt_and_tied_llama_convert_both_ways(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoo import GPT, GPTConfig
    from zoo.convert import ConversionError, hf_to_zoo, load_hf_as_zoo, save_hf, zoo_to_hf

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 24))
    gpt = GPT(GPTConfig.from_preset("tiny", tie_embeddings=True)).eval()
    with torch.no_grad():
        llama = zoo_to_hf(gpt)
        assert llama.config.tie_word_embeddings and llama.lm_head.weight is llama.model.embed_tokens.weight
        assert _max_diff(llama(input_ids=tokens).logits, gpt(tokens)) <= 1e-5
        save_hf(gpt, tmp_path / "tied")  # transformers writes the shared matrix once
        with safe_open(str(tmp_path / "tied" / "model.safetensors"), framework="pt") as f:
            assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
        for back in (hf_to_zoo(LlamaForCausalLM.from_pretrained(tmp_path / "tied")), load_hf_as_zoo(tmp_path / "tied")):
            assert back.config.tie_embeddings and back.output.weight is back.tok_embeddings.weight
            assert _max_diff(back(tokens), gpt(tokens)) <= 1e-5
        hf = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                tie_word_embeddings=True,
            )
        ).eval()
        zoo = hf_to_zoo(hf)
        assert zoo.config.tie_embeddings and _max_diff(zoo(tokens), hf(input_ids=tokens).logits) <= 1e-5
        # an untied head cannot go into a tied model silently
        untied = GPT(GPTConfig.from_preset("tiny")).state_dict()
        from zoo.convert.api import CONVERTERS, zoo_state_to_hf

        with pytest.raises(
            ConversionError,
            match="model.embed_tokens.weight and lm_head.weight hold different values, but the model ties them",
        ):
            zoo_state_to_hf(CONVERTERS["llama"], untied, GPTConfig.from_preset("tiny", tie_embeddings=True))


def test_zoo_vit_and_transformers_vit_give_the_same_logits_both_ways(tmp_path: Path) -> None:
    from transformers import ViTForImageClassification

    from zoo import ViT, ViTConfig
    from zoo.convert import hf_to_zoo, load_hf_as_zoo, save_hf, zoo_to_hf

    torch.manual_seed(0)
    images = torch.rand(3, 1, 8, 8)
    vit = ViT(ViTConfig.from_preset("tiny", n_registers=0)).eval()
    with torch.no_grad():
        hf = zoo_to_hf(vit)
        assert _max_diff(hf(pixel_values=images).logits, vit(images)) <= 1e-5
        # through a transformers directory (config.json + safetensors), both ways
        save_hf(vit, tmp_path / "vit")
        assert list((tmp_path / "vit").glob("*.safetensors"))
        loaded = ViTForImageClassification.from_pretrained(tmp_path / "vit").eval()
        assert _max_diff(loaded(pixel_values=images).logits, vit(images)) <= 1e-5
        assert _max_diff(load_hf_as_zoo(tmp_path / "vit")(images), vit(images)) <= 1e-5
        hf.vit.layers[1].mlp.fc1.weight.mul_(1.05)  # a transformers model with weights of its own
        assert _max_diff(hf_to_zoo(hf)(images), hf(pixel_values=images).logits) <= 1e-5
        assert _max_diff(hf(pixel_values=images).logits, vit(images)) > 1e-5


def test_zoo_moe_and_mixtral_give_the_same_logits_both_ways(tmp_path: Path) -> None:
    """The zoo MoE's default routing is Mixtral's (softmax over all experts, top-k renormalised): exact maps."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from zoo.convert import hf_to_zoo, load_hf_as_zoo, save_hf, zoo_to_hf
    from zoo.convert.mixtral import to_moe_config
    from zoo.moe import MoEConfig, MoETransformer

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 24))
    moe = MoETransformer(MoEConfig.from_preset("tiny")).eval()
    with torch.no_grad():
        hf = zoo_to_hf(moe)
        # the config maps back, but for the dense width (no dense layer uses it): the expert width comes back
        assert to_moe_config(hf.config) == dataclasses.replace(moe.config, ffn_hidden=moe.config.expert_hidden)
        assert _max_diff(hf(input_ids=tokens).logits, moe(tokens)) <= 1e-5
        mixtral = MixtralForCausalLM(
            MixtralConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=48,
                num_hidden_layers=3,
                num_attention_heads=8,
                num_key_value_heads=2,
                num_local_experts=6,
                num_experts_per_tok=3,
            )
        ).eval()
        assert _max_diff(hf_to_zoo(mixtral)(tokens), mixtral(input_ids=tokens).logits) <= 1e-5
        # through a directory: transformers writes the hub's per-expert layout, read back here
        save_hf(moe, tmp_path / "mixtral")
        loaded = MixtralForCausalLM.from_pretrained(tmp_path / "mixtral")
        assert _max_diff(loaded(input_ids=tokens).logits, moe(tokens)) <= 1e-5
        assert _max_diff(load_hf_as_zoo(tmp_path / "mixtral")(tokens), moe(tokens)) <= 1e-5
        # the check can fail: one expert's up projection (the second half of gate_up_proj) changed
        hf.model.layers[1].mlp.experts.gate_up_proj[:, 64:].mul_(1.01)
        assert _max_diff(hf(input_ids=tokens).logits, moe(tokens)) > 1e-5


def test_zoo_moe_without_mixtral_routing_is_refused() -> None:
    from zoo.convert import ConversionError, zoo_to_hf
    from zoo.convert.mixtral import to_mixtral_config
    from zoo.moe import MoEConfig, MoETransformer

    with pytest.raises(ValueError, match=r"MoEConfig with \{'score_func': 'sigmoid', 'n_shared_experts': 1\}") as error:
        to_mixtral_config(MoEConfig.from_preset("tiny", score_func="sigmoid", n_shared_experts=1))
    assert "convert a zoo MoE built with {'score_func': 'softmax', 'n_shared_experts': 0}" in str(error.value)
    moe = MoETransformer(MoEConfig.from_preset("tiny"))
    moe.layers[0].moe.router.expert_bias.bias.fill_(0.5)  # balancing bias trained, then bias_update_rate reset
    with pytest.raises(ConversionError, match="layers.0.moe.router.expert_bias.bias holds values the transformers"):
        zoo_to_hf(moe)


def test_zoo_weights_of_a_module_without_a_preset_need_their_config(tmp_path: Path) -> None:
    """A user's LightningModule holding a zoo GPT: no preset to read, so export asks for the config instead of
    guessing one; given it, the export loads in transformers with the same logits."""
    from transformers import LlamaForCausalLM

    from zoo import GPT, GPTConfig
    from zoo.convert import ConversionError, export_hf

    config = GPTConfig.from_preset("tiny", n_layers=3)
    gpt = GPT(config).eval()
    checkpoint = tmp_path / "own.ckpt"
    torch.save(
        {"state_dict": {f"model.{k}": v for k, v in gpt.state_dict().items()}, "hyper_parameters": {}}, checkpoint
    )
    with pytest.raises(ConversionError, match=r"zoo GPT weights but no 'preset'.*config=GPTConfig.from_preset"):
        export_hf(checkpoint, tmp_path / "guessed")
    llama = LlamaForCausalLM.from_pretrained(export_hf(checkpoint, tmp_path / "hf", config=config)).eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (llama(input_ids=tokens).logits - gpt(tokens)).abs().max().item() <= 1e-5


def test_conversion_between_mismatched_shapes_names_the_tensors() -> None:
    from zoo import GPT, GPTConfig, ViTConfig
    from zoo.convert import ConversionError
    from zoo.convert.api import zoo_state_to_hf
    from zoo.convert.llama import LLAMA
    from zoo.convert.vit import to_vit_hf_config

    with torch.device("meta"):
        state = GPT(GPTConfig.from_preset("tiny")).state_dict()
    with pytest.raises(ConversionError) as error:
        zoo_state_to_hf(LLAMA, state, GPTConfig.from_preset("tiny", dim=128, n_heads=8))
    message = str(error.value)
    assert "do not fit the transformers model LlamaForCausalLM" in message
    assert "model.embed_tokens.weight: (256, 64) given, (256, 128) expected" in message
    assert "convert with the configuration the weights were trained with" in message
    with pytest.raises(ValueError, match="n_registers=3: transformers' ViT has no register tokens"):
        to_vit_hf_config(ViTConfig.from_preset("tiny"))
    # zoo MoE -> Mixtral with another expert width: the fused tensor is named, with both shapes
    from zoo.convert.mixtral import MIXTRAL
    from zoo.moe import MoEConfig, MoETransformer

    with torch.device("meta"):
        state = MoETransformer(MoEConfig.from_preset("tiny")).state_dict()
    with pytest.raises(ConversionError) as error:
        zoo_state_to_hf(MIXTRAL, state, MoEConfig.from_preset("tiny", expert_hidden=32))
    message = str(error.value)
    assert "do not fit the transformers model MixtralForCausalLM" in message
    assert "model.layers.0.mlp.experts.gate_up_proj: (4, 128, 64) given, (4, 64, 64) expected" in message
    assert "convert with the configuration the weights were trained with" in message
    # transformers -> zoo: a Llama state dict read with a config of another width
    from transformers import LlamaForCausalLM

    from zoo.convert.api import hf_state_to_zoo
    from zoo.hf import tiny_config

    with torch.device("meta"):
        llama_state = LlamaForCausalLM(tiny_config("llama")).state_dict()
    with pytest.raises(ConversionError) as error:
        hf_state_to_zoo(LLAMA, llama_state, tiny_config("llama", hidden_size=128))
    message = str(error.value)
    assert "the weights do not fit the zoo model GPT" in message
    assert "tok_embeddings.weight: (256, 64) given, (256, 128) expected" in message


def test_plans_are_selected_by_class_and_can_be_named() -> None:
    from transformers import AutoModelForCausalLM

    from lit_mesh.hf import declared_plan, plan_for, register_plan, use_plan
    from lit_mesh.parallel.apply import find_plan_owners
    from zoo.hf import tiny_config

    with torch.device("meta"):
        llama = AutoModelForCausalLM.from_config(tiny_config("llama"))
        opt = AutoModelForCausalLM.from_config(tiny_config("opt"))
    plan = plan_for(llama)  # transformers' own TP plan, plus SP and the blocks
    assert plan.blocks == "model.layers"
    assert plan.tp.block["self_attn.q_proj"] == "colwise" and plan.tp.block["mlp.down_proj"] == "rowwise"
    assert plan.tp.block["self_attn"] == "gather_input" and plan.tp.block["input_layernorm"] == "norm"
    assert plan.tp.root["lm_head"] == "head" and plan.tp.root["model.embed_tokens"] == "embedding_whole_output"
    assert plan.tp.root["model.layers.0"] == "shard_input"
    assert plan.tp.divides == {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    # found inside a LightningModule-like root, only the outermost transformers model
    root = torch.nn.Module()
    root.model = llama
    assert [(o.name, o.plan.blocks) for o in find_plan_owners(root)] == [("model", "model.layers")]
    assert declared_plan(torch.nn.Linear(2, 2)) is None
    # no known plan: FSDP per decoder layer, TP refused by name
    assert plan_for(opt).blocks == "model.decoder.layers" and "OPTForCausalLM" in plan_for(opt).tp.unavailable
    # named explicitly: for one model, or for a class
    assert plan_for(use_plan(opt, lambda m: plan)) is plan
    register_plan("OPTForCausalLM", lambda m: plan)
    try:
        with torch.device("meta"):
            another_opt = AutoModelForCausalLM.from_config(tiny_config("opt"))
        assert plan_for(another_opt) is plan
    finally:
        from lit_mesh.hf.registry import _BY_CLASS

        _BY_CLASS.pop("OPTForCausalLM")
    with pytest.raises(ValueError, match="unknown architecture 'bert'"):
        register_plan("BertModel", "bert")


def test_qwen3_norms_over_each_head_are_heads_norm_and_others_of_that_style_refused() -> None:
    """transformers' "replicated_with_grad_allreduce" (Qwen3's q_norm / k_norm, a norm over one head's features on
    this rank's heads) is lit-mesh's "heads_norm"; the same style on anything else leaves TP unavailable, named."""
    from transformers import AutoModelForCausalLM

    from lit_mesh.hf import plan_for
    from lit_mesh.hf.from_config import plan_from_hf
    from lit_mesh.parallel.tensor import torch_style
    from zoo.hf import tiny_config

    with torch.device("meta"):
        qwen3 = AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    plan = plan_for(qwen3)
    assert plan.tp.unavailable == "" and plan.cp.unavailable == ""
    assert plan.tp.block["self_attn.q_norm"] == plan.tp.block["self_attn.k_norm"] == "heads_norm"
    style = torch_style("heads_norm", sequence_parallel=False)  # heads are split with or without SP
    assert style is not None and style.sequence_sharding[0].dim == 2  # type: ignore[attr-defined]
    wrong = {"model.layers.*.input_layernorm": "replicated_with_grad_allreduce"}  # a norm over the hidden size
    refused = plan_from_hf(qwen3, {}, wrong).tp.unavailable
    assert "uses styles lit-mesh does not apply: {'model.layers.*.input_layernorm'" in refused


def test_qwen3_moe_takes_mixtrals_plan_and_adapter() -> None:
    """Qwen3-MoE: the same MoE parts as Mixtral (router, gate_up_proj / down_proj), so the same plan and adapter give
    transformers' own logits; tp divides the experts' width; a model mixing dense layers in is refused by name."""
    from transformers import AutoModelForCausalLM

    from lit_mesh.hf import plan_for
    from lit_mesh.plan import PlanError
    from zoo.hf import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        reference = model(input_ids=tokens).logits
    plan = plan_for(model)
    assert plan.moe is not None and plan.moe.layer == "mlp" and plan.tp.block["mlp"] == "whole_sequence"
    assert plan.tp.block["self_attn.q_norm"] == "heads_norm"
    assert plan.tp.divides["moe_intermediate_size"] == 64 and "intermediate_size" not in plan.tp.divides
    for layer in model.model.layers:
        plan.moe.adapter(layer.mlp)  # type: ignore[misc]
    with torch.no_grad():
        assert _max_diff(model(input_ids=tokens).logits, reference) <= 1e-5
    with torch.device("meta"):
        mixed = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", decoder_sparse_step=2))
    with pytest.raises(PlanError, match="decoder_sparse_step=2, mlp_only_layers=\\[\\] mixes dense and MoE layers"):
        plan_for(mixed)


def test_mixtral_plan_and_its_expert_adapter() -> None:
    """Attention TP from transformers' plan, the MoE block whole over tp (its experts' width split), EP through the adapter, which
    computes what transformers' own MoE block does (same parameters and names)."""
    import copy

    from transformers import AutoModelForCausalLM

    from lit_mesh.hf import plan_for
    from lit_mesh.parallel.expert import adapt_moe_layers, expert_modules
    from zoo.hf import tiny_config

    torch.manual_seed(0)
    mixtral = AutoModelForCausalLM.from_config(tiny_config("mixtral")).eval()
    plan = plan_for(mixtral)
    assert plan.blocks == "model.layers" and plan.moe.layer == "mlp" and plan.moe.ep_divides == {"num_local_experts": 4}
    assert plan.tp.block["self_attn.q_proj"] == "colwise" and plan.tp.block["self_attn.o_proj"] == "rowwise"
    assert plan.tp.block["mlp"] == "whole_sequence" and not any(k.startswith("mlp.") for k in plan.tp.block)
    # intermediate_size: expert tensor parallel splits each expert's width over tp, gate_up_proj by halves
    assert plan.tp.divides == {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 256,
    }
    assert plan.moe.hidden_dims == {"gate_up_proj": 1, "down_proj": 2} and plan.moe.packed == ("gate_up_proj",)
    # pipeline stages as Llama's; no balancing loss carried through them (its router aux loss is refused under pp)
    assert plan.pp.first == ("model.embed_tokens",) and plan.pp.last == ("model.norm", "lm_head")
    assert plan.pp.stage is not None and not plan.moe.balancing_under_pp
    assert plan_for(mixtral.model).pp.stage is None  # the base model: no head, no stages
    adapted = copy.deepcopy(mixtral)
    adapt_moe_layers(adapted, plan)
    adapt_moe_layers(adapted, plan)  # idempotent
    assert expert_modules(adapted, plan)[0] is adapted.model.layers[0].mlp.experts
    assert adapted.state_dict().keys() == mixtral.state_dict().keys()
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        assert _max_diff(adapted(input_ids=tokens).logits, mixtral(input_ids=tokens).logits) <= 1e-5
        adapted.model.layers[0].mlp.experts.down_proj[1].mul_(1.01)  # the adapter's experts are used
        assert _max_diff(adapted(input_ids=tokens).logits, mixtral(input_ids=tokens).logits) > 1e-5
