"""Hugging Face transformers models under MeshStrategy across ranks (conversions in one process: tests/unit/test_hf.py).

Layout parity through the `lit-mesh` CLI (fp32: relative 1e-4 per step over 10 steps, final full parameters
1e-4): transformers GPT-2 and Llama in a plain LightningModule (zoo.hf.HFCausalLM) under tp2 and fsdp2 x tp2,
ViT under fsdp2, Llama built whole in __init__ (not on the meta device) under tp2, and the user example
examples/hf_model.py under tp2; a saved Mixtral loaded into zoo.MoEModule(pretrained=DIR) on ep2 and ep2 x fsdp
(transformers' logits; each rank reads only its own slices); context parallel (cp2: Llama with ring, Ulysses and
all-gather, the last with transformers' own label shift; Qwen2 and Mistral on one style each; Llama on fsdp2 x cp2
and cp2 x tp2; Llama on pp2 x cp2 through examples/hf_pipeline.py); Qwen3 (q/k norms over each head, heads wider
than hidden / heads) under fsdp2 x tp2, cp2 and pp2, and Qwen3-MoE under tp2 x ep2; a GPT-2 checkpoint of pp2 x tp2 resumed on fsdp4 (tied embeddings,
optimizer state); Mixtral built whole under pp2 (1F1B) and pp2 x ep2 (GPipe, experts FSDP-sharded per layer). One
torchrun launch per world size (1, 2, 4) runs every run, the export checkpoints and the error cases. Each run also records how the mesh was
really applied (DTensor placements, FSDP2 units, MoE dispatchers: tests/workers/hf_runs.py), so that a run that
silently stayed replicated cannot pass parity.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from lit_mesh.hf.context import ATTENTION as CP_ATTENTION
from tests.launch import REPO, launch

STEPS = 10
S = "--trainer.strategy.init_args."
QUIET = [
    f"--trainer.max_steps={STEPS}",
    "--trainer.log_every_n_steps=1",
    "--trainer.logger=CSVLogger",
    "--seed_everything=0",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]
NO_CKPT = ["--trainer.enable_checkpointing=false"]
TEXT = ["-c", str(REPO / "configs/gpt.yaml"), "--data.global_batch_size=8", "--model=zoo.hf.HFCausalLM"]
IMAGES = ["-c", str(REPO / "configs/vit.yaml"), "--model=zoo.hf.HFImageClassifier"]


# a checkpointed run validates never (HFCausalLM has a validation_step; with validation configured but not reached
# in STEPS steps, ModelCheckpoint would wait for it and save nothing): it saves at the end of training
CKPT = ["--trainer.limit_val_batches=0"]


def _fit(name: str, n: int, base: list[str], *extra: str, checkpoint: bool = False) -> dict:
    args = [*base, f"--trainer.devices={n}", *QUIET, *(CKPT if checkpoint else NO_CKPT), *extra]
    return {"kind": "fit", "name": name, "args": args}


def _gpt2(*extra: str) -> tuple[str, ...]:
    return ("--model.init_args.architecture=gpt2", *extra)


def _error(name: str, *extra: str) -> dict:
    args = [*TEXT, "--trainer.devices=2", "--trainer.max_steps=1", "--trainer.logger=false", *NO_CKPT, *extra]
    return {"kind": "error", "name": name, "args": args}


# name -> the single-device run it must match
PARITY = {
    "llama-tp2": "llama-single",
    "llama-fsdp2_tp2": "llama-single",
    "gpt2-tp2": "gpt2-single",
    "gpt2-fsdp2_tp2": "gpt2-single",
    "vit-fsdp2": "vit-single",
    "llama-init-tp2": "llama-init-single",  # built whole in __init__ (as from_pretrained), then sharded
    "mixtral-fsdp2": "mixtral-single",
    "mixtral-tp2": "mixtral-single",
    "mixtral-ep2": "mixtral-single",
    "mixtral-tp2_ep2": "mixtral-single",
    "qwen3_moe-tp2_ep2": "qwen3_moe-single",  # Mixtral's plan and adapter, q/k norms over each head
    # built whole in __init__: built on the meta device, transformers' init would run per stage (docs/transformers.md)
    "mixtral-init-pp2": "mixtral-init-single",  # 1F1B, each stage's MoE blocks dispatching
    "mixtral-init-pp2_ep2_ac": "mixtral-init-single",  # GPipe; ep2 inside the stages; full AC per layer
    "qwen2-tp2": "qwen2-single",  # Qwen- and Mistral-style decoders: transformers' own TP plan, our SP
    # Qwen3: heads wider than hidden / heads, q_norm / k_norm over each head (replicated, gradient summed over tp)
    "qwen3-fsdp2_tp2": "qwen3-single",
    "qwen3-cp2_ring": "qwen3-single",
    "mistral-tp2": "mistral-single",
    # context parallel (lit_mesh/hf/context.py): each cp style on Llama, Qwen2 and Mistral on one each, and cp x fsdp
    "llama-cp2_ring": "llama-single",
    "llama-cp2_ulysses": "llama-single",
    "llama-cp2_allgather-labels": "llama-labels-single",  # transformers shifts the labels: globally under cp
    "qwen2-cp2_ulysses": "qwen2-single",
    "mistral-cp2_allgather": "mistral-single",
    "llama-fsdp2_cp2": "llama-single",
    "llama-cp2_tp2": "llama-single",  # tensor parallel (with SP) inside each cp rank
}
MIXTRAL = "--model.init_args.architecture=mixtral"
# the zoo MoE (configs/moe.yaml) without the balancing bias, which Mixtral has no place for
ZOO_MOE = ["-c", str(REPO / "configs/moe.yaml"), "--model.init_args.config_overrides={bias_update_rate: 0.0}"]
INIT = "--model.init_args.build=init"
LABELS = "--model=tests.workers.hf_modules.LabelsCausalLM"
# examples/hf_pipeline.py (the user's `model(input_ids, labels).loss` under pp): name -> (world size, its flags);
# PP_STEPS steps each (suite time: the curve's first steps already hold every stage, schedule and tied sum)
PP_STEPS = 4
INTERLEAVED = ("--schedule", "interleaved_1f1b")
PIPELINE_EXAMPLES: dict[str, tuple[int, tuple[str, ...]]] = {
    "pp-llama-single": (1, ()),
    "pp-gpt2-single": (1, ("--arch", "gpt2")),
    "pp-llama-pp2": (2, ("--pp", "2")),  # 1F1B
    "pp-gpt2-pp2-gpipe": (2, ("--arch", "gpt2", "--pp", "2", "--schedule", "gpipe")),  # tied embeddings
    # sequence parallel between the stages: later stages get the whole sequence's positions (rotary) and causal mask
    "pp-gpt2-pp2_tp2": (4, ("--arch", "gpt2", "--pp", "2", "--tp", "2")),  # tied copies sharded over tp
    "pp-llama-pp2_tp2": (4, ("--pp", "2", "--tp", "2")),
    # ring cp inside the stages: global positions per stage, transformers' labels shifted over the whole sequence
    "pp-llama-pp2_cp2": (4, ("--pp", "2", "--cp", "2")),
    # two stages per rank (4 layers: one per stage), against a 4-layer single-device run
    "pp-llama4-single": (1, ("--layers", "4")),
    "pp-llama4-pp2-interleaved": (2, ("--layers", "4", "--pp", "2", "--stages-per-rank", "2", *INTERLEAVED)),
    # V placement with split backward: torch detaches each stage's output in place (a view would refuse)
    "pp-llama4-pp2-zbv": (2, ("--layers", "4", "--pp", "2", "--stages-per-rank", "2", "--schedule", "zbv")),
    "pp-llama4-pp2-dualpipev": (
        2,
        ("--layers", "4", "--pp", "2", "--stages-per-rank", "2", "--schedule", "dualpipev", "--microbatches", "4"),
    ),
}


def _pipeline_example(name: str, n: int, *extra: str) -> dict:
    args = ["hf_pipeline.py", "--devices", str(n), "--max-steps", str(PP_STEPS), *extra]
    return {"kind": "example", "name": f"example-{name}", "args": args}


LAUNCHES: dict[int, list[dict]] = {
    1: [
        _fit("llama-single", 1, TEXT),
        _fit("gpt2-single", 1, TEXT, *_gpt2()),
        _fit("vit-single", 1, IMAGES),
        _fit("llama-init-single", 1, TEXT, INIT),
        _fit("qwen3-init-single", 1, TEXT, INIT, "--model.init_args.architecture=qwen3"),
        _fit("mixtral-single", 1, TEXT, MIXTRAL),
        _fit("qwen3_moe-single", 1, TEXT, "--model.init_args.architecture=qwen3_moe"),
        _fit("mixtral-init-single", 1, TEXT, MIXTRAL, INIT),
        _fit("qwen2-single", 1, TEXT, "--model.init_args.architecture=qwen2"),
        _fit("qwen3-single", 1, TEXT, "--model.init_args.architecture=qwen3"),
        _fit("mistral-single", 1, TEXT, "--model.init_args.architecture=mistral"),
        {"kind": "example", "name": "example-single", "args": ["hf_model.py", "--devices", "1"]},
        _fit("llama-labels-single", 1, TEXT, LABELS),
        *(_pipeline_example(name, 1, *extra) for name, (n, extra) in PIPELINE_EXAMPLES.items() if n == 1),
    ],
    2: [
        _fit("llama-tp2", 2, TEXT, f"{S}tp=2", checkpoint=True),  # its checkpoint is exported below
        _fit("gpt2-tp2", 2, TEXT, *_gpt2(f"{S}tp=2"), checkpoint=True),
        _fit("vit-fsdp2", 2, IMAGES, f"{S}dp=2", checkpoint=True),  # its checkpoint is exported below
        _fit("llama-init-tp2", 2, TEXT, INIT, f"{S}tp=2"),
        _fit("qwen2-tp2", 2, TEXT, "--model.init_args.architecture=qwen2", f"{S}tp=2"),
        _fit("mistral-tp2", 2, TEXT, "--model.init_args.architecture=mistral", f"{S}tp=2"),
        # a zoo GPT trained sharded, exported to a transformers Llama directory
        _fit(
            "zoo-gpt-fsdp2",
            2,
            ["-c", str(REPO / "configs/gpt.yaml"), "--data.global_batch_size=8"],
            f"{S}dp=2",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            checkpoint=True,
        ),
        _fit("mixtral-fsdp2", 2, TEXT, MIXTRAL, f"{S}dp=2"),
        _fit("mixtral-tp2", 2, TEXT, MIXTRAL, f"{S}tp=2", checkpoint=True),  # experts split over tp: saved, resumed
        _fit("mixtral-tp2-resumed", 2, TEXT, MIXTRAL, f"{S}tp=2", "--ckpt_path=@mixtral-tp2"),  # at step 10: loads only
        _fit("mixtral-ep2", 2, TEXT, MIXTRAL, f"{S}ep=2", checkpoint=True),  # exported below
        _fit("mixtral-init-pp2", 2, TEXT, MIXTRAL, INIT, f"{S}pp=2"),
        # a zoo MoE trained with experts split over ep=2, exported to a transformers Mixtral directory
        _fit(
            "zoo-moe-ep2",
            2,
            ZOO_MOE,
            f"{S}ep=2",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=0",
            checkpoint=True,
        ),
        {"kind": "example", "name": "example-tp2", "args": ["hf_model.py", "--devices", "2", "--tp", "2"]},
        _fit("llama-cp2_ring", 2, TEXT, f"{S}cp=2"),
        _fit("llama-cp2_ulysses", 2, TEXT, f"{S}cp=2", f"{S}cp_style=ulysses"),
        _fit("llama-cp2_allgather-labels", 2, TEXT, LABELS, f"{S}cp=2", f"{S}cp_style=allgather"),
        _fit("qwen2-cp2_ulysses", 2, TEXT, "--model.init_args.architecture=qwen2", f"{S}cp=2", f"{S}cp_style=ulysses"),
        _fit("qwen3-cp2_ring", 2, TEXT, "--model.init_args.architecture=qwen3", f"{S}cp=2"),
        _fit(
            "mistral-cp2_allgather",
            2,
            TEXT,
            "--model.init_args.architecture=mistral",
            f"{S}cp=2",
            f"{S}cp_style=allgather",
        ),
        *(_pipeline_example(name, 2, *extra) for name, (n, extra) in PIPELINE_EXAMPLES.items() if n == 2),
        _fit("llama-init-pp2", 2, TEXT, INIT, f"{S}pp=2"),  # zoo.hf.HFCausalLM through loss_of, from the CLI
        _fit("qwen3-init-pp2", 2, TEXT, INIT, "--model.init_args.architecture=qwen3", f"{S}pp=2"),
        _error("no_plan", f"{S}tp=2", "--model.init_args.architecture=opt"),
        _error("tp_vs_kv_heads", f"{S}tp=2", "--model.init_args.config_overrides={num_key_value_heads: 1}"),
        _error("sp_vs_seq_len", f"{S}tp=2", "--data.init_args.seq_len=63"),
        _error("gpt2_tp_vs_heads", f"{S}tp=2", *_gpt2("--model.init_args.config_overrides={n_head: 1}")),
        _error("ep_vs_experts", f"{S}ep=2", MIXTRAL, "--model.init_args.config_overrides={num_local_experts: 3}"),
    ],
    4: [
        _fit("llama-fsdp2_tp2", 4, TEXT, f"{S}tp=2"),
        _fit("qwen3-fsdp2_tp2", 4, TEXT, "--model.init_args.architecture=qwen3", f"{S}tp=2"),
        _fit("gpt2-fsdp2_tp2", 4, TEXT, *_gpt2(f"{S}tp=2")),
        _fit("mixtral-tp2_ep2", 4, TEXT, MIXTRAL, f"{S}tp=2", f"{S}ep=2"),
        _fit("qwen3_moe-tp2_ep2", 4, TEXT, "--model.init_args.architecture=qwen3_moe", f"{S}tp=2", f"{S}ep=2"),
        _fit(
            "mixtral-init-pp2_ep2_ac",
            4,
            TEXT,
            MIXTRAL,
            INIT,
            *(f"{S}pp=2", f"{S}ep=2", f"{S}pp_schedule=gpipe", f"{S}activation_checkpointing=full"),
        ),
        _fit("llama-fsdp2_cp2", 4, TEXT, f"{S}cp=2"),
        _fit("llama-cp2_tp2", 4, TEXT, f"{S}cp=2", f"{S}tp=2"),
        *(_pipeline_example(name, 4, *extra) for name, (n, extra) in PIPELINE_EXAMPLES.items() if n == 4),
    ],
}


# zoo.MoEModule(pretrained=DIR) from a transformers Mixtral directory (4 experts), predicting with the experts split
# over ep=2: on 2 ranks (2 experts per rank; the dense parts FSDP 2), and on 4 (the dense parts FSDP 4; each
# expert FSDP-sharded over the 2 ranks of its ep rank's dp_shard)
PRETRAINED_EP = {2: "moe-pretrained-ep2", 4: "moe-pretrained-ep2_fsdp4"}


def _save_mixtral(directory: Path) -> Path:
    from transformers import MixtralForCausalLM

    from zoo.hf.configs import tiny_config

    torch.manual_seed(0)
    MixtralForCausalLM(tiny_config("mixtral", tie_word_embeddings=False)).save_pretrained(
        directory, max_shard_size="60KB"
    )
    return directory


def _pretrained_ep(out: Path, nproc: int) -> dict:
    predictions = out / PRETRAINED_EP[nproc] / "predictions"
    args = [
        "-c",
        str(REPO / "configs/moe.yaml"),
        f"--model.init_args.pretrained={out / 'mixtral-pretrained'}",
        f"--trainer.devices={nproc}",
        f"{S}ep=2",
        "--trainer.limit_predict_batches=1",
        "--seed_everything=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.callbacks+=tests.workers.cli_runs.SavePredictions",
        f"--trainer.callbacks.output_dir={predictions}",
        "--trainer.callbacks+=tests.workers.hf_runs.RecordReads",
        f"--trainer.callbacks.output_dir={predictions}",
    ]
    return {"kind": "predict", "name": PRETRAINED_EP[nproc], "args": args}


# zoo.hf.HFCausalLM(pretrained=DIR) from a saved GPT-2 (tied embeddings), on one device and on pp2: built on the meta
# device, each stage reads only its own parameters (the head's copy the embedding's tensor); name -> world size
PRETRAINED_PP = {"gpt2-pretrained-single": 1, "gpt2-pretrained-pp2": 2}


def _save_gpt2(directory: Path) -> Path:
    from transformers import GPT2LMHeadModel

    from zoo.hf.configs import tiny_config

    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_config("gpt2")).save_pretrained(directory)
    return directory


def _pretrained_pp(out: Path, nproc: int) -> list[dict]:
    pretrained = f"--model.init_args.pretrained={out / 'gpt2-pretrained'}"
    pp = [f"{S}pp=2"] if nproc == 2 else []
    # the pp2 run's checkpoint is exported below (export-hf from a pipeline checkpoint)
    return [_fit(name, n, TEXT, pretrained, *pp, checkpoint=n > 1) for name, n in PRETRAINED_PP.items() if n == nproc]


# resume across layouts (#35 item 6): the saved GPT-2 (tied embeddings, so every layout starts from its weights)
# trained on pp2 x tp2 to step 2 with a checkpoint, resumed on fsdp4 to step 4 with a checkpoint, resumed on
# pp2 x tp2 again to step 6: both moves in one launch of 4 ranks; name -> (layout, last step, the run it resumes)
PP_TP = (f"{S}pp=2", f"{S}tp=2", f"{S}sequence_parallel=false")  # tp without SP here: with SP in the pp examples
RESUMES: dict[str, tuple[tuple[str, ...], int, str]] = {
    "gpt2-pretrained-pp2_tp2": (PP_TP, 2, ""),
    "gpt2-pretrained-fsdp4": ((f"{S}dp=4",), 4, "gpt2-pretrained-pp2_tp2"),
    "gpt2-pretrained-pp2_tp2-again": (PP_TP, 6, "gpt2-pretrained-fsdp4"),
}


def _resume_across_layouts(out: Path) -> list[dict]:
    pretrained = f"--model.init_args.pretrained={out / 'gpt2-pretrained'}"
    resumed_from = {of for _, _, of in RESUMES.values()}  # these save a checkpoint (at their last step)
    runs = []
    for name, (layout, last, of) in RESUMES.items():
        resume = [f"--ckpt_path=@{of}"] if of else []
        args = (pretrained, *layout, f"--trainer.max_steps={last}", *resume)
        runs.append(_fit(name, 4, TEXT, *args, checkpoint=name in resumed_from))
    return runs


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    _save_mixtral(out / "mixtral-pretrained")
    _save_gpt2(out / "gpt2-pretrained")
    for nproc, runs in LAUNCHES.items():
        spec = out / f"runs_{nproc}.json"
        extra = [*([_pretrained_ep(out, nproc)] if nproc in PRETRAINED_EP else []), *_pretrained_pp(out, nproc)]
        extra += _resume_across_layouts(out) if nproc == 4 else []
        spec.write_text(json.dumps([*runs, *extra]))
        proc = launch(nproc, "hf_runs.py", str(out), str(spec), timeout=600)
        if proc.returncode != 0:
            raise AssertionError(
                f"hf_runs with {nproc} processes failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            )
    return out


def losses(out: Path, name: str) -> list[float]:
    per_step = json.loads((out / name / "result.json").read_text())["metrics"]["train_loss"]
    return [per_step[s] for s in sorted(per_step, key=int)]


def assert_same_curve(reference: list[float], got: list[float], what: str) -> None:
    assert len(reference) == len(got) == STEPS, (what, reference, got)
    for step, (a, b) in enumerate(zip(reference, got), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: {what} loss {b} vs single-device {a}"


@pytest.mark.parametrize("name", sorted(PARITY))
def test_transformers_model_matches_single_device(out: Path, name: str) -> None:
    reference = losses(out, PARITY[name])
    assert len(set(reference)) == STEPS, "the reference run must update the model at every step"
    assert_same_curve(reference, losses(out, name), name)
    ref_params = torch.load(out / PARITY[name] / "params.pt", weights_only=True)
    params = torch.load(out / name / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys()
    for key, ref in ref_params.items():
        diff = (params[key] - ref).abs().max().item()
        assert diff <= 1e-4, f"{name}: parameter {key} differs by {diff}"


def test_parity_check_can_fail(out: Path) -> None:
    """Another model, or a 1e-3 nudge of one step, is caught."""
    with pytest.raises(AssertionError):
        assert_same_curve(losses(out, "llama-single"), losses(out, "gpt2-single"), "another model")
    nudged = [v * (1 + 1e-3) if i == 4 else v for i, v in enumerate(losses(out, "llama-tp2"))]
    with pytest.raises(AssertionError):
        assert_same_curve(losses(out, "llama-single"), nudged, "nudged")


# ---- the layouts were really applied (OUT/NAME/layout.json, see tests/workers/hf_runs.py) --------------------


@dataclasses.dataclass(frozen=True)
class Applied:
    """What a layout must leave on the model after training."""

    blocks: str  # the ModuleList of decoder/encoder layers, under the LightningModule
    tp: dict[str, str]  # in every block: parameter -> its placement over the tp dim ({}: no tp dim)
    fsdp: bool  # the model and every block FSDPModules, every block parameter sharded (see fsdp_sharded)
    ep: int = 0  # MoE layers: all-to-all dispatch over ep ranks, experts split by id (0: no MoE)
    attention: str = ""  # the model's attn_implementation at the end ("" : not checked)
    pp: int = 1  # pipeline stages: rank 0 holds the first stage (its blocks, not the head)
    ac: bool = False  # every block held wrapped by activation checkpointing (else none)


LLAMA_TP = {
    "self_attn.q_proj.weight": "S(0)",
    "self_attn.o_proj.weight": "S(1)",
    "mlp.up_proj.weight": "S(0)",
    "mlp.down_proj.weight": "S(1)",
    "input_layernorm.weight": "R",
}
# the fused c_attn stays replicated over tp (lit_mesh/hf/conv1d.py); Conv1D weights are (in, out)
GPT2_TP = {
    "attn.c_attn.weight": "R",
    "attn.c_proj.weight": "S(0)",
    "mlp.c_fc.weight": "S(1)",
    "mlp.c_proj.weight": "S(0)",
}
# the MoE block runs whole over tp; its experts' width is split over tp (gate_up_proj (E, 2I, D) stacks [gate; up]:
# each tp rank holds its slice of both halves, a strided shard; down_proj (E, D, I))
MIXTRAL_TP = {
    "self_attn.q_proj.weight": "S(0)",
    "self_attn.o_proj.weight": "S(1)",
    "mlp.gate.weight": "R",
    "mlp.experts.gate_up_proj": "_S(1, 2)",
    "mlp.experts.down_proj": "S(2)",
}
# the blocks: Llama-style decoder layers (Llama, Qwen2, Mistral, Mixtral), GPT-2 blocks, ViT layers
DECODER, GPT2, VIT = "model.model.layers", "model.transformer.h", "model.vit.layers"
APPLIED = {
    "llama-tp2": Applied(DECODER, LLAMA_TP, fsdp=False),
    "llama-init-tp2": Applied(DECODER, LLAMA_TP, fsdp=False),
    "qwen2-tp2": Applied(DECODER, LLAMA_TP, fsdp=False),
    "mistral-tp2": Applied(DECODER, LLAMA_TP, fsdp=False),
    "llama-fsdp2_tp2": Applied(DECODER, LLAMA_TP, fsdp=True),
    "qwen3-fsdp2_tp2": Applied(
        DECODER, {**LLAMA_TP, "self_attn.q_norm.weight": "R", "self_attn.k_norm.weight": "R"}, fsdp=True
    ),
    "gpt2-tp2": Applied(GPT2, GPT2_TP, fsdp=False),
    "gpt2-fsdp2_tp2": Applied(GPT2, GPT2_TP, fsdp=True),
    "vit-fsdp2": Applied(VIT, {}, fsdp=True),
    "mixtral-fsdp2": Applied(DECODER, {}, fsdp=True, ep=1),
    "mixtral-tp2": Applied(DECODER, MIXTRAL_TP, fsdp=False, ep=1),
    "mixtral-ep2": Applied(DECODER, {}, fsdp=True, ep=2),
    "mixtral-tp2_ep2": Applied(DECODER, MIXTRAL_TP, fsdp=True, ep=2),
    "qwen3_moe-tp2_ep2": Applied(
        DECODER, {**MIXTRAL_TP, "self_attn.q_norm.weight": "R", "self_attn.k_norm.weight": "R"}, fsdp=True, ep=2
    ),
    "mixtral-init-pp2": Applied(DECODER, {}, fsdp=False, ep=1, pp=2),
    "mixtral-init-pp2_ep2_ac": Applied(DECODER, {}, fsdp=True, ep=2, pp=2, ac=True),
    # cp alone: FSDP2 over dp_shard_cp; every attention through context parallel's (transformers' registry)
    **{name: Applied(DECODER, {}, fsdp=True, attention=CP_ATTENTION) for name in PARITY if "cp2" in name},
    "llama-cp2_tp2": Applied(DECODER, LLAMA_TP, fsdp=True, attention=CP_ATTENTION),  # FSDP2 over the cp ranks
}
EXPERTS = "mlp.experts."
EMBED = "model.model.embed_tokens.weight"  # Llama-style decoders' (the first pp stage's)


def applied(out: Path, name: str) -> dict:
    return json.loads((out / name / "layout.json").read_text())


def params_by_block(found: dict, blocks: str) -> dict[str, dict[str, dict]]:
    """{block name: {parameter name inside the block: its record}}"""
    by_block: dict[str, dict[str, dict]] = {}
    for name, record in found["params"].items():
        if name.startswith(f"{blocks}."):
            index, _, inner = name.removeprefix(f"{blocks}.").partition(".")
            by_block.setdefault(f"{blocks}.{index}", {})[inner] = record
    return by_block


def fsdp_sharded(inner: str, record: dict) -> bool:
    """FSDP2 sharded this parameter: by dim 0 over dp_shard_cp, experts by dim 1 over efsdp (dim 0 is ep's; dim 2
    where tp splits dim 1)."""
    placements = record["placements"]
    if inner.startswith(EXPERTS):
        over_tp = re.sub(r"_?S\((\d).*", r"S(\1)", placements.get("tp", ""))
        return placements.get("efsdp") in ("S(1)", "S(2)") and placements.get("efsdp") != over_tp
    # over a tp shard of dim 0, FSDP2's dim-0 shard is a strided one: _S(0, tp)
    return re.fullmatch(r"_?S\(0(, \d+)?\)", placements.get("dp_shard_cp", "")) is not None


def assert_experts(found: dict, block: str, params: dict[str, dict], expected: Applied, what: str) -> None:
    experts = {inner: record for inner, record in params.items() if inner.startswith(EXPERTS)}
    assert bool(experts) == bool(expected.ep), f"{what}: {block} experts {sorted(experts)}"
    for inner, record in experts.items():  # split by expert id over ep: this rank holds 1/ep of them
        local, full = record["local_shape"], record["shape"]
        if not (expected.fsdp or expected.tp or expected.ep > 1):  # pp alone: no mesh dim over the experts
            assert record["placements"] == {} and local == full, f"{what}: {block}.{inner} is {record}"
            continue
        assert record["placements"].get("ep") == "S(0)", f"{what}: {block}.{inner} is {record['placements']}"
        assert local[0] * expected.ep == full[0], f"{what}: {block}.{inner} {local} of {full}: not 1/{expected.ep}"
        if inner in expected.tp:  # expert tensor parallel: 1/tp of each expert's width (gate_up: dim 1, down: dim 2)
            hidden = 1 if "gate_up" in inner else 2
            assert local[hidden] * 2 == full[hidden], f"{what}: {block}.{inner} {local} of {full}: width not 1/2"
    if expected.ep and expected.fsdp:
        assert f"{block}.mlp.experts" in found["fsdp"], f"{what}: {block}'s experts are no FSDPModule"


def assert_applied(found: dict, expected: Applied, what: str) -> None:
    blocks = params_by_block(found, expected.blocks)
    # the tiny configs have 2 blocks: the first of pp2 stages holds one, and not the head
    held = len(blocks), "model.lm_head.weight" in found["params"]
    assert held == (1, False) if expected.pp > 1 else held[0] >= 2, f"{what}: blocks held, head held: {held}"
    # under pp each stage module is the FSDP root (outside the LightningModule's tree): the embedding sharded by it
    root_sharded = "model" in found["fsdp"] if expected.pp == 1 else fsdp_sharded("", found["params"][EMBED])
    assert root_sharded == expected.fsdp, f"{what}: FSDP2 units {found['fsdp']}"
    for block, params in blocks.items():
        over_tp = {inner: record["placements"].get("tp") for inner, record in params.items()}
        assert {inner: over_tp[inner] for inner in expected.tp} == expected.tp, f"{what}: {block} over tp: {over_tp}"
        assert expected.tp or set(over_tp.values()) == {None}, f"{what}: {block} over tp: {over_tp}"
        assert (block in found["fsdp"]) == expected.fsdp, f"{what}: {block} is an FSDPModule: {not expected.fsdp}"
        wrong = [inner for inner, record in params.items() if fsdp_sharded(inner, record) != expected.fsdp]
        assert not wrong, f"{what}: FSDP2 sharded (expected {expected.fsdp}) not so for {block}: {wrong}"
        assert_experts(found, block, params, expected, what)
        assert (block in found["checkpointed"]) == expected.ac, f"{what}: {block} checkpointed: {not expected.ac}"
    assert not expected.attention or found["attention"] == expected.attention, f"{what}: {found['attention']}"
    dispatchers = {layer: (moe["dispatcher"], moe["ep"]) for layer, moe in found["moe"].items()}
    want = {f"{block}.mlp": ("AllToAllDispatch", expected.ep) for block in blocks} if expected.ep else {}
    assert dispatchers == want, f"{what}: MoE dispatchers {dispatchers}"


@pytest.mark.parametrize("name", sorted(PARITY))
def test_layout_was_really_applied(out: Path, name: str) -> None:
    assert APPLIED.keys() == PARITY.keys(), "every parity run must prove its layout"
    assert_applied(applied(out, name), APPLIED[name], name)


def test_layout_check_can_fail(out: Path) -> None:
    """A single-device record (plain tensors, no FSDP2 unit, LocalDispatch) fails every layout's check; so does
    tp2 checked as fsdp2 x tp2, fsdp2 checked as ep2, a cp run whose attention stayed transformers' own, and an AC
    run whose blocks were not checkpointed."""
    for name, expected in APPLIED.items():
        with pytest.raises(AssertionError):
            assert_applied(applied(out, PARITY[name]), expected, PARITY[name])
    with pytest.raises(AssertionError, match="FSDP2 units"):
        assert_applied(applied(out, "llama-tp2"), APPLIED["llama-fsdp2_tp2"], "llama-tp2")
    with pytest.raises(AssertionError, match="not 1/2"):
        assert_applied(applied(out, "mixtral-fsdp2"), APPLIED["mixtral-ep2"], "mixtral-fsdp2")
    with pytest.raises(AssertionError, match="sdpa"):  # FSDP2 as under cp, but transformers' own attention
        assert_applied({**applied(out, "llama-cp2_ring"), "attention": "sdpa"}, APPLIED["llama-cp2_ring"], "sdpa")
    name = "mixtral-init-pp2_ep2_ac"  # the same run with its blocks unwrapped
    with pytest.raises(AssertionError, match="checkpointed"):
        assert_applied({**applied(out, name), "checkpointed": []}, APPLIED[name], name)


def test_example_matches_single_device(out: Path) -> None:
    single = json.loads((out / "example-single.json").read_text())
    tp2 = json.loads((out / "example-tp2.json").read_text())
    assert (single["world_size"], tp2["world_size"]) == (1, 2)
    assert len(set(single["losses"])) == STEPS and single["losses"][-1] < single["losses"][0]
    for step, (a, b) in enumerate(zip(single["losses"], tp2["losses"], strict=True), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"example step {step}: tp2 {b} vs single {a}"


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_hf_causal_lm_under_pp_matches_single_device(out: Path, architecture: str) -> None:
    """zoo.hf.HFCausalLM (loss_of) from the CLI on pp=2: the single-device curve and final parameters; rank 0 held
    the first stage only (one of the two decoder layers, the embedding, no head). Qwen3's stages come from the
    Llama names, its q/k norms inside the attention."""
    single, pp2 = f"{architecture}-init-single", f"{architecture}-init-pp2"
    assert_same_curve(losses(out, single), losses(out, pp2), pp2)
    ref_params = torch.load(out / single / "params.pt", weights_only=True)
    params = torch.load(out / pp2 / "params.pt", weights_only=True)
    assert ref_params.keys() == params.keys()
    for key, ref in ref_params.items():
        assert (params[key] - ref).abs().max().item() <= 1e-4, f"{pp2}: parameter {key}"
    held = applied(out, pp2)
    assert set(params_by_block(held, DECODER)) == {f"{DECODER}.0"}
    assert "model.model.embed_tokens.weight" in held["params"] and "model.lm_head.weight" not in held["params"]


def test_pretrained_gpt2_under_pp_matches_single_device(out: Path) -> None:
    """HFCausalLM(pretrained=DIR) on pp2: the single-device curve from the same saved weights (tied embeddings)."""
    assert_same_curve(losses(out, "gpt2-pretrained-single"), losses(out, "gpt2-pretrained-pp2"), "pretrained pp2")


def test_checkpoints_resume_across_pp_tp_and_fsdp(out: Path) -> None:
    """GPT-2 checkpoints move pp2 x tp2 -> fsdp4 -> pp2 x tp2 (the tied matrix a copy on each end stage under pp,
    every tensor split over tp; one parameter sharded by FSDP2 on fsdp4): the single-device curve throughout. The
    steps after the first resumed one hold the loaded AdamW state (moments and step count), the head's copy's
    included: a fresh state moves otherwise."""
    curve, last = [], 0
    for name, (_, steps, _) in RESUMES.items():
        part = losses(out, name)
        assert len(part) == steps - last, (name, part)
        curve, last = curve + part, steps
    reference = losses(out, "gpt2-pretrained-single")[:last]
    for step, (a, b) in enumerate(zip(reference, curve, strict=True), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: pp2 x tp2 <-> fsdp4 loss {b} vs single-device {a}"
    # the layouts were what they say: rank 0 held the first stage (the embedding, block 0), split over tp; on
    # fsdp4 the whole model, the tied matrix one parameter, FSDP2 units sharded over dp
    for name in ("gpt2-pretrained-pp2_tp2", "gpt2-pretrained-pp2_tp2-again"):
        blocks = params_by_block(applied(out, name), GPT2)
        assert set(blocks) == {f"{GPT2}.0"} and "model.lm_head.weight" not in applied(out, name)["params"], name
        over_tp = {inner: record["placements"].get("tp") for inner, record in blocks[f"{GPT2}.0"].items()}
        assert {inner: over_tp[inner] for inner in GPT2_TP} == GPT2_TP, (name, over_tp)
    fsdp = applied(out, "gpt2-pretrained-fsdp4")
    assert_applied(fsdp, Applied(GPT2, {}, fsdp=True), "gpt2-pretrained-fsdp4")
    assert "model.lm_head.weight" not in fsdp["params"] and "model.transformer.wte.weight" in fsdp["params"]


@pytest.mark.parametrize("name", [name for name, (n, _) in PIPELINE_EXAMPLES.items() if n > 1])
def test_users_own_loss_call_under_pp_matches_single_device(out: Path, name: str) -> None:
    """`self.model(input_ids=x, labels=x).loss` unchanged: the pipeline runs inside the call, in training and in
    validation, and the losses follow the single-device run (GPT-2's tied embeddings on both end stages)."""
    reference = json.loads((out / f"example-pp-{name.split('-')[1]}-single.json").read_text())
    got = json.loads((out / f"example-{name}.json").read_text())
    assert got["world_size"] == PIPELINE_EXAMPLES[name][0]
    assert len(set(reference["losses"])) == PP_STEPS and reference["losses"][-1] < reference["losses"][0]
    for what in ("losses", "val_losses"):
        assert len(got[what]) == len(reference[what]) > 0, what
        for step, (a, b) in enumerate(zip(reference[what], got[what], strict=True), start=1):
            assert abs(a - b) <= 1e-4 * abs(a), f"{name} {what} {step}: {b} vs single {a}"


def _checkpoint(out: Path, name: str) -> Path:
    found = sorted((out / name).rglob("*.ckpt"))
    assert found, f"{name} wrote no checkpoint"
    assert found[-1].is_dir(), "MeshStrategy writes sharded checkpoints (a directory)"
    return found[-1]


@pytest.mark.parametrize(
    ("name", "architecture"),
    [
        ("llama-tp2", "llama"),
        ("gpt2-tp2", "gpt2"),
        ("mixtral-ep2", "mixtral"),
        ("mixtral-tp2", "mixtral"),
        ("gpt2-pretrained-pp2", "gpt2"),  # each stage saved its own parameters (the tied matrix on both ends)
    ],
)
def test_exported_checkpoint_loads_with_from_pretrained(
    out: Path, tmp_path: Path, name: str, architecture: str
) -> None:
    """A tp2-sharded checkpoint -> transformers directory -> from_pretrained: the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from zoo.convert import export_hf
    from zoo.hf import tiny_config

    directory = export_hf(_checkpoint(out, name), tmp_path / "hf")
    assert (directory / "config.json").is_file() and list(directory.glob("*.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    trained = AutoModelForCausalLM.from_config(tiny_config(architecture)).eval()
    weights = torch.load(out / name / "params.pt", weights_only=True)
    trained.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(input_ids=tokens).logits - trained(input_ids=tokens).logits).abs().max().item() <= 1e-5


def test_experts_split_by_halves_over_tp_save_and_load_back(out: Path) -> None:
    """Mixtral under tp2 holds each half's slice of gate_up_proj ([gate; up]), which torch's DCP cannot write as it
    is: saved as plain shards, and put back on resume (lit_mesh/checkpoint/files.py). The resumed run (at the last step:
    it loads, trains nothing) ends with exactly the saved weights."""
    saved = torch.load(out / "mixtral-tp2" / "params.pt", weights_only=True)
    resumed = torch.load(out / "mixtral-tp2-resumed" / "params.pt", weights_only=True)
    assert saved.keys() == resumed.keys() and any(EXPERTS + "gate_up_proj" in k for k in saved)
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), key


def test_exported_vit_checkpoint_loads_with_from_pretrained(out: Path, tmp_path: Path) -> None:
    """The fsdp2-sharded checkpoint of a transformers ViT -> transformers directory -> from_pretrained: same logits."""
    from transformers import ViTForImageClassification

    from zoo.convert import export_hf
    from zoo.hf import tiny_config

    directory = export_hf(_checkpoint(out, "vit-fsdp2"), tmp_path / "vit")
    loaded = ViTForImageClassification.from_pretrained(directory).eval()
    trained = ViTForImageClassification(tiny_config("vit")).eval()
    weights = torch.load(out / "vit-fsdp2" / "params.pt", weights_only=True)
    trained.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    images = torch.rand(
        3,
        trained.config.num_channels,
        trained.config.image_size,
        trained.config.image_size,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        assert _max_diff(loaded(pixel_values=images).logits, trained(pixel_values=images).logits) <= 1e-5


def test_exported_zoo_gpt_checkpoint_is_a_llama(out: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from zoo import GPT, GPTConfig
    from zoo.convert import export_hf

    directory = export_hf(_checkpoint(out, "zoo-gpt-fsdp2"), tmp_path / "llama")
    llama = LlamaForCausalLM.from_pretrained(directory).eval()
    gpt = GPT(GPTConfig.from_preset("tiny")).eval()
    weights = torch.load(out / "zoo-gpt-fsdp2" / "params.pt", weights_only=True)
    gpt.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (llama(input_ids=tokens).logits - gpt(tokens)).abs().max().item() <= 1e-5


def test_exported_zoo_moe_checkpoint_is_a_mixtral(out: Path, tmp_path: Path) -> None:
    """A zoo MoE trained with its experts split over ep=2 (sharded checkpoint) -> from_pretrained: same logits."""
    from transformers import MixtralForCausalLM

    from zoo.convert import export_hf
    from zoo.moe import MoEConfig, MoETransformer

    directory = export_hf(_checkpoint(out, "zoo-moe-ep2"), tmp_path / "mixtral")
    mixtral = MixtralForCausalLM.from_pretrained(directory).eval()
    moe = MoETransformer(MoEConfig.from_preset("tiny", bias_update_rate=0.0)).eval()
    weights = torch.load(out / "zoo-moe-ep2" / "params.pt", weights_only=True)
    moe.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (mixtral(input_ids=tokens).logits - moe(tokens)).abs().max().item() <= 1e-5
        # the check can fail: the untrained model gives other logits
        untrained = MoETransformer(MoEConfig.from_preset("tiny")).eval()
        assert (mixtral(input_ids=tokens).logits - untrained(tokens)).abs().max().item() > 1e-5


@pytest.mark.parametrize("nproc", sorted(PRETRAINED_EP))
def test_pretrained_mixtral_on_ep_gives_transformers_logits(out: Path, nproc: int) -> None:
    from transformers import MixtralForCausalLM

    files = sorted((out / PRETRAINED_EP[nproc] / "predictions").glob("rank*-batch0.pt"))
    assert len(files) == nproc, files
    reference = MixtralForCausalLM.from_pretrained(out / "mixtral-pretrained").eval()
    for file in files:
        record = torch.load(file, weights_only=True)
        with torch.no_grad():
            expected = reference(input_ids=record["inputs"]).logits
        torch.testing.assert_close(record["predictions"], expected, rtol=1e-5, atol=1e-5)


def _indices(runs: list[list[int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.zeros(0, dtype=torch.long)


@pytest.mark.parametrize("nproc", sorted(PRETRAINED_EP))
def test_pretrained_ep_ranks_read_only_their_own_slices(out: Path, nproc: int) -> None:
    """Across ranks every element of every file tensor is read exactly once (no rank reads what another holds,
    none a whole dense tensor), and each rank reads the per-expert tensors of its own 2 experts of 4 only."""
    from zoo.pretrained import directory_tensors

    reads = [
        json.loads(f.read_text()) for f in sorted((out / PRETRAINED_EP[nproc] / "predictions").glob("reads-rank*.json"))
    ]
    assert len(reads) == nproc
    tensors = directory_tensors(out / "mixtral-pretrained")
    assert set().union(*reads) == set(tensors), "every tensor of the directory is read by some rank"
    for key, tensor in tensors.items():
        count = torch.zeros(tensor.shape, dtype=torch.int32)
        for rank_reads in reads:
            for per_dim in rank_reads.get(key, {"reads": []})["reads"]:
                count[torch.meshgrid(*map(_indices, per_dim), indexing="ij")] += 1
        assert bool((count == 1).all()), f"{key}: read {count.min().item()} to {count.max().item()} times across ranks"
    expert = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.experts\.(\d+)\.w[123]\.weight$")
    for rank, rank_reads in enumerate(reads):
        experts = {int(m[1]) for key in rank_reads if (m := expert.match(key))}
        assert experts in ({0, 1}, {2, 3}), f"rank {rank} read the tensors of experts {sorted(experts)}"


def test_errors_name_the_model_and_the_fix(out: Path) -> None:
    errors = json.loads((out / "errors_2.json").read_text())
    message = errors["no_plan"]["message"]
    assert "tp=2: no tensor-parallel plan is known for the transformers model OPTForCausalLM" in message
    assert "lit_mesh.hf.register_plan('OPTForCausalLM', builder)" in message and "tp=1" in message
    message = errors["tp_vs_kv_heads"]["message"]
    assert "tp=2 does not divide num_key_value_heads=1 of LlamaForCausalLM (choose tp in [1])" in message
    message = errors["gpt2_tp_vs_heads"]["message"]
    assert "tp=2 does not divide n_head=1 of GPT2LMHeadModel (choose tp in [1])" in message
    # sequence parallelism shards the first decoder layer's input: an odd length is refused there, by number
    message = errors["sp_vs_seq_len"]["message"]
    assert "sequence length divisible by tp: model.layers.0 sees length 63, tp=2" in message
    assert "sequence_parallel=False" in message
    message = errors["ep_vs_experts"]["message"]
    assert "ep=2 does not divide num_local_experts=3 of MixtralForCausalLM (choose ep in [1, 3])" in message


# ---- in this process: conversions and plan selection ------------------------------------------------------


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
