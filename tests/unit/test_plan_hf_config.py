"""`lit-mesh plan --hf-config`: a transformers config.json planned with the zoo family of its shape
(lit_mesh/planner/hf_config.py). The configs are written by transformers itself, and the planned parameter count
is the transformers model's own (built on the meta device)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lit_mesh.planner.command import main as plan_main
from lit_mesh.planner.families import family
from lit_mesh.planner.hf_config import read_hf_config
from lit_mesh.planner.shapes import gpt_shapes

# the config.json keys the planner reads, small
SHAPE: dict[str, Any] = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}
SHAPE |= {"num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 512}
# model_type -> (transformers config class, extra fields, the family planned, bias parameters the zoo shape has not)
CASES: dict[str, tuple[str, dict[str, Any], str, int]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}, "gpt", 0),
    "qwen2": ("Qwen2Config", {}, "gpt", 3 * (64 + 2 * 32)),  # q, k and v biases per layer
    "mistral": ("MistralConfig", {"rope_theta": 1e6}, "gpt", 0),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, "moe", 0),
    # Qwen3: heads of head_dim 32 (not 64 / 4), its QK-norm weights (2 x head_dim per layer) left out
    "qwen3": ("Qwen3Config", {"head_dim": 32}, "gpt", 3 * 2 * 32),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 96, "norm_topk_prob": True},
        "moe",
        3 * 2 * 16,
    ),
}


def _save(directory: Path, model_type: str, **fields: Any) -> Path:
    import transformers

    name, extra, _, _ = CASES[model_type]
    getattr(transformers, name)(**{**SHAPE, **extra, **fields}).save_pretrained(directory)
    return directory


def _transformers_numel(directory: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    return sum(p.numel() for p in model.parameters())  # a tied weight once


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_planned_shapes_are_the_configs(tmp_path: Path, model_type: str) -> None:
    directory = _save(tmp_path / model_type, model_type)
    name, fields, read_type = read_hf_config(directory)
    _, extra, family_name, biases = CASES[model_type]
    assert (name, read_type) == (family_name, model_type)
    config = family(name).config("tiny", **fields)
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.vocab_size) == (64, 3, 4, 2, 320)
    assert config.max_seq_len == 512
    if name == "gpt":
        assert config.ffn_hidden == 96 and config.tie_embeddings == extra.get("tie_word_embeddings", False)
    else:
        assert (config.n_experts, config.top_k, config.expert_hidden, config.moe_every) == (4, 2, 96, 1)
        assert config.normalize_top_k and config.score_func == "softmax"
    assert config.attention_head_dim == extra.get("head_dim", 16)
    assert gpt_shapes(config).numel() + biases == _transformers_numel(directory)
    assert read_hf_config(directory / "config.json")[1] == fields  # the file itself reads the same


@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_heads_of_another_width_are_planned_at_their_width(tmp_path: Path, model_type: str) -> None:
    """head_dim x heads != hidden_size (Qwen3, Mistral-Nemo): the planned wq and wo are (heads x head_dim, dim)."""
    directory = _save(tmp_path / model_type, model_type, head_dim=32)
    name, fields, _ = read_hf_config(directory)
    assert fields["head_dim"] == 32
    shapes = gpt_shapes(family(name).config("tiny", **fields))
    assert {p.name: p.shape for p in shapes.block}["attention.wq.weight"] == (4 * 32, 64)
    assert gpt_shapes(family(name).config("tiny", **fields)).numel() == _transformers_numel(directory)


def test_qwen3_moe_layers_and_routing_are_its_own(tmp_path: Path) -> None:
    """decoder_sparse_step 2: the zoo's moe_every 2 (layers 1, 3, ... MoE, the others dense of intermediate_size),
    which the planner then refuses by name (it models identical blocks); norm_topk_prob false keeps the chosen
    probabilities; dense layers named by mlp_only_layers are refused by name."""
    directory = _save(
        tmp_path / "sparse", "qwen3_moe", decoder_sparse_step=2, norm_topk_prob=False, num_hidden_layers=4
    )
    name, fields, _ = read_hf_config(directory)
    config = family(name).config("tiny", **fields)
    assert (config.moe_every, config.normalize_top_k, config.ffn_hidden) == (2, False, 96)
    with pytest.raises(ValueError, match="moe_every=2: the planner models identical blocks"):
        gpt_shapes(config)
    # the Hub's Qwen3-MoE files (saved before transformers 5) name the experts num_experts
    raw = json.loads((directory / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    assert read_hf_config(_write(tmp_path, **raw))[1] == fields
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[0\] makes those layers dense"):
        read_hf_config(_save(tmp_path / "dense0", "qwen3_moe", mlp_only_layers=[0]))


def test_plan_command_on_a_transformers_directory(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    directory = _save(tmp_path / "llama", "llama", num_hidden_layers=4, tie_word_embeddings=False)
    out = tmp_path / "plan.yaml"
    argv = ["--hf-config", str(directory), "--devices", "8", "--seq-len", "256", "--global-batch", "16"]
    assert plan_main([*argv, "--out", str(out), "--json"]) == 0
    text = capsys.readouterr().out
    assert f"lit-mesh plan: llama ({directory})" in text
    assert json.loads(text.strip().splitlines()[-1])["ranked"]
    model = yaml.safe_load(out.read_text())["model"]
    overrides = model["init_args"]["config_overrides"]
    assert (overrides["dim"], overrides["n_layers"], overrides["ffn_hidden"], overrides["vocab_size"]) == (
        64,
        4,
        96,
        320,
    )
    # --config-overrides still applies, over the file's shape
    assert plan_main([*argv, "--config-overrides", "{n_layers: 6}", "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["model"]["init_args"]["config_overrides"]["n_layers"] == 6


def _write(tmp_path: Path, **config: Any) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


BAD = [
    (
        {"model_type": "gpt2", "n_embd": 64},
        "model_type 'gpt2' is not planned; lit-mesh plan reads llama, mistral, mixtral, qwen2",
    ),
    ({**SHAPE, "model_type": "llama", "hidden_size": None}, "hidden_size=None; the planner needs it as a whole number"),
    ({**SHAPE, "model_type": "llama", "head_dim": 0}, "head_dim=0; the planner needs it as a whole number >= 1"),
    (
        {
            **SHAPE,
            "model_type": "mixtral",
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": True,
        },
        "a mixtral with tie_word_embeddings=true is not planned",
    ),
    (
        {**SHAPE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        | {"decoder_sparse_step": 0},
        "decoder_sparse_step=0; the planner needs it as a whole number >= 1",
    ),
]


@pytest.mark.parametrize(("config", "message"), BAD, ids=["gpt2", "missing", "head_dim", "tied-mixtral", "sparse-step"])
def test_configs_not_planned_are_refused_by_name(
    capsys: pytest.CaptureFixture, tmp_path: Path, config: dict, message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--hf-config", str(_write(tmp_path, **config)), "--devices", "8"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--preset", "tiny"], "--preset tiny and --hf-config"),
        (["--model", "moe"], "a llama config is planned as the gpt family; drop --model"),
    ],
)
def test_hf_config_with_a_preset_or_another_family_is_refused(
    capsys: pytest.CaptureFixture, tmp_path: Path, extra: list[str], message: str
) -> None:
    path = _write(tmp_path, **SHAPE, model_type="llama")
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--hf-config", str(path), "--devices", "8", *extra])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_config_names_what_to_give(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        plan_main(["--hf-config", str(tmp_path), "--devices", "8"])
    assert "a directory without config.json" in capsys.readouterr().err
