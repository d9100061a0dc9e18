"""Real data and pretrained weights across ranks, in one 4-rank launch: the fine-tuning recipe end to end on
fsdp2 x tp2 (first loss == transformers' on the same batch, export-hf, transformers loads the export), logits of
the pretrained model loaded into fsdp2 x tp2 == transformers', and TokenDataModule's exact resume on another
layout (fsdp2 x tp2 -> fsdp4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lit_mesh.cli import run as lit_mesh
from tests.launch import REPO, cli_runs
from tests.token_corpus import VOCAB, prepare_shards, save_tiny_llama, train_tokenizer
from zoo.token_data import TokenDataModule

S = "--trainer.strategy.init_args."
QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
SEQ, BATCH = 32, 8


def _finetune_args(llama: Path, shards: Path) -> list[str]:
    return [
        "-c",
        str(REPO / "configs/finetune.yaml"),
        f"--model.init_args.pretrained={llama}",
        f"--data.init_args.path={shards}",
        f"--data.init_args.seq_len={SEQ}",
        f"--data.init_args.global_batch_size={BATCH}",
        "--trainer.devices=4",
        f"{S}tp=2",
        *QUIET,
    ]


def _token_gpt(shards: Path, ckpt: Path, steps: int, layout: list[str], *extra: str) -> list[str]:
    return [
        "-c",
        str(REPO / "configs/gpt.yaml"),
        "--data=zoo.TokenDataModule",
        f"--data.path={shards}",
        f"--data.seq_len={SEQ}",
        f"--data.global_batch_size={BATCH}",
        f"--model.init_args.config_overrides={{vocab_size: {VOCAB}}}",
        "--trainer.devices=4",
        *layout,
        f"--trainer.max_steps={steps}",
        "--trainer.log_every_n_steps=1",
        "--trainer.logger=CSVLogger",
        "--trainer.limit_val_batches=0",
        "--seed_everything=0",
        "--trainer.callbacks+=ModelCheckpoint",
        f"--trainer.callbacks.dirpath={ckpt}",
        "--trainer.callbacks.every_n_train_steps=3",
        "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.filename={step}",
        *QUIET,
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("finetune")
    tokenizer = train_tokenizer(out / "tokenizer")
    shards = prepare_shards(tokenizer, out / "shards")
    llama = save_tiny_llama(out / "llama")
    finetune = _finetune_args(llama, shards)
    results = cli_runs(
        4,
        out,
        [
            {
                "name": "finetune",
                "args": [
                    *finetune,
                    "--trainer.max_steps=4",
                    "--trainer.log_every_n_steps=1",
                    "--trainer.val_check_interval=2",
                    "--trainer.limit_val_batches=1",
                    "--trainer.logger=CSVLogger",
                ],
            },
            {
                "name": "predict",
                "command": "predict",
                "args": [
                    *finetune,
                    "--trainer.limit_predict_batches=1",
                    "--trainer.callbacks+=tests.workers.cli_runs.SavePredictions",
                    f"--trainer.callbacks.output_dir={out / 'predictions'}",
                ],
            },
            {"name": "token-fsdp4", "args": _token_gpt(shards, out / "ckpt-fsdp4", 6, [f"{S}dp=4"])},
            {"name": "token-fsdp2-tp2", "args": _token_gpt(shards, out / "ckpt-first", 3, [f"{S}tp=2"])},
            {
                "name": "token-resumed-fsdp4",
                "args": _token_gpt(
                    shards, out / "ckpt-resumed", 6, [f"{S}dp=4"], f"--ckpt_path={out / 'ckpt-first' / 'step=3.ckpt'}"
                ),
            },
        ],
    )
    return out, results


def _by_step(metric: dict[str, float]) -> dict[int, float]:
    return {int(step): value for step, value in metric.items()}


def _hf(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


def test_first_finetuning_loss_equals_transformers_on_the_same_batch(runs: tuple[Path, dict]) -> None:
    out, results = runs
    data = TokenDataModule(path=str(out / "shards"), seq_len=SEQ, global_batch_size=BATCH)
    data.setup()
    tokens, targets = next(iter(data.train_dataloader()))  # global batch 0, whole (one rank's view)
    with torch.no_grad():
        expected = F.cross_entropy(_hf(out / "llama")(input_ids=tokens).logits.flatten(0, 1), targets.flatten()).item()
    metrics = {name: _by_step(values) for name, values in results["finetune"]["metrics"].items()}
    assert metrics["train_loss"][0] == pytest.approx(expected, rel=1e-5)
    assert {"grad_norm", "val_loss", "val_ppl", "lr-AdamW"} <= set(metrics), sorted(metrics)
    assert metrics["val_ppl"][1] == pytest.approx(torch.tensor(metrics["val_loss"][1]).exp().item(), rel=1e-4)
    lr = [metrics["lr-AdamW"][s] for s in sorted(metrics["lr-AdamW"])]
    assert lr[0] < lr[-1] <= 2e-5, "linear warm-up of transformers' cosine schedule"


def test_pretrained_logits_on_fsdp2_tp2_equal_transformers(runs: tuple[Path, dict]) -> None:
    out, _ = runs
    files = sorted((out / "predictions").glob("rank*-batch0.pt"))
    assert len(files) == 4
    reference = _hf(out / "llama")
    for file in files:
        record = torch.load(file, weights_only=True)
        with torch.no_grad():
            expected = reference(input_ids=record["inputs"]).logits
        torch.testing.assert_close(record["predictions"], expected, rtol=1e-5, atol=1e-5)


def test_export_hf_of_the_finetuned_checkpoint_loads_in_transformers(runs: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = runs
    checkpoint = next((out / "finetune").rglob("last.ckpt"))
    assert checkpoint.is_dir(), "a sharded checkpoint"
    lit_mesh(["export-hf", str(checkpoint), str(tmp_path / "exported")])
    exported = _hf(tmp_path / "exported")
    trained = _hf(out / "llama")
    params = torch.load(out / "finetune" / "params.pt", weights_only=True)
    trained.load_state_dict({name.removeprefix("model."): t for name, t in params.items()}, strict=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, trained(input_ids=tokens).logits, rtol=0, atol=0)
        assert not torch.equal(exported(input_ids=tokens).logits, _hf(out / "llama")(input_ids=tokens).logits)


def test_token_data_resumes_exactly_on_another_layout(runs: tuple[Path, dict]) -> None:
    _, results = runs
    full, first, resumed = (
        _by_step(results[name]["metrics"]["train_loss"])
        for name in ("token-fsdp4", "token-fsdp2-tp2", "token-resumed-fsdp4")
    )
    assert sorted(first) == [0, 1, 2] and sorted(resumed) == [3, 4, 5]
    for step in range(6):
        got = (first if step < 3 else resumed)[step]
        assert got == pytest.approx(full[step], rel=1e-5), step
