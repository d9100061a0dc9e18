"""Resume on another mesh (issue #8): a checkpoint saved with one layout loads into another; parameters and
optimizer state arrive equal (full tensors) and the next 5 steps follow the uninterrupted run. The MoE move also
changes how the experts are shared over tp: split by hidden unit (tp2 x ep2) to whole experts (expert_tp=1, ep4 over
dp_shard 2 x tp 2); DCP reshards them by their global shapes, which both ways keep."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.launch import REPO, cli_runs

S = "--trainer.strategy.init_args."
MESHES = {
    "fsdp4": (4, [f"{S}dp=4"]),
    "fsdp2_tp2": (4, [f"{S}tp=2"]),
    "hsdp2x2": (4, [f"{S}dp_replicate=2", f"{S}dp_shard=2"]),
    "tp2": (2, [f"{S}tp=2"]),
    "single": (1, []),
    "moe_tp2_ep2": (4, [f"{S}tp=2", f"{S}ep=2"]),
    "moe_tp2_ep4_whole": (4, [f"{S}tp=2", f"{S}ep=4", f"{S}expert_tp=1"]),
    "moe_single": (1, []),
}
MOVES = [("fsdp4", "fsdp2_tp2"), ("tp2", "single"), ("hsdp2x2", "fsdp4"), ("moe_tp2_ep2", "moe_tp2_ep4_whole")]


def _config(mesh: str) -> str:
    return "moe" if mesh.startswith("moe_") else "gpt"


def _reference(mesh: str) -> str:
    return f"{_config(mesh)}-reference"


def _args(mesh: str, max_steps: int, out: Path, name: str, dump: str, *extra: str) -> list[str]:
    devices, degrees = MESHES[mesh]
    return [
        "-c",
        str(REPO / f"configs/{_config(mesh)}.yaml"),
        f"--trainer.devices={devices}",
        *degrees,
        f"--trainer.max_steps={max_steps}",
        "--trainer.log_every_n_steps=1",
        "--trainer.logger=CSVLogger",
        "--data.global_batch_size=8",
        "--seed_everything=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks+=ModelCheckpoint",
        f"--trainer.callbacks.dirpath={out / name / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=5",
        "--trainer.callbacks.filename={step}",
        "--trainer.callbacks+=tests.workers.state_dump.DumpFullState",
        f"--trainer.callbacks.path={out / f'{name}-{dump}.pt'}",
        f"--trainer.callbacks.when={dump}",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("reshard")
    plan: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for single in ("single", "moe_single"):
        name = _reference(single)
        plan[1].append({"name": name, "args": _args(single, 10, out, name, "end")})
    for source, _target in MOVES:
        plan[MESHES[source][0]].append(
            {"name": f"{source}-first5", "args": _args(source, 5, out, f"{source}-first5", "end")}
        )
    for source, target in MOVES:
        ckpt = out / f"{source}-first5" / "ckpt" / "step=5.ckpt"
        name = f"{target}-from-{source}"
        plan[MESHES[target][0]].append(
            {"name": name, "args": _args(target, 10, out, name, "start", f"--ckpt_path={ckpt}")}
        )
    results: dict = {}
    for nproc in (4, 2, 1):  # sources first: the 4-process launch also resumes hsdp -> fsdp4 after saving
        results.update(cli_runs(nproc, out, sorted(plan[nproc], key=lambda r: "-from-" in r["name"])))
    return out, results


@pytest.mark.parametrize(("source", "target"), MOVES)
def test_state_arrives_equal_on_the_new_mesh(runs: tuple[Path, dict], source: str, target: str) -> None:
    out, _ = runs
    saved = torch.load(out / f"{source}-first5-end.pt", weights_only=True)
    loaded = torch.load(out / f"{target}-from-{source}-start.pt", weights_only=True)
    assert saved["model"].keys() == loaded["model"].keys()
    if _config(source) == "moe":  # the experts are what this move reshards
        assert any(name.endswith("experts.w1") for name in saved["model"]), list(saved["model"])
    for name, tensor in saved["model"].items():
        torch.testing.assert_close(loaded["model"][name], tensor, rtol=0, atol=0)
    assert saved["optimizer"].keys() == loaded["optimizer"].keys() and saved["optimizer"]
    for name, state in saved["optimizer"].items():
        for key, value in state.items():  # exp_avg, exp_avg_sq, step
            torch.testing.assert_close(loaded["optimizer"][name][key], value, rtol=0, atol=0)


@pytest.mark.parametrize(("source", "target"), MOVES)
def test_loss_curve_continues_on_the_new_mesh(runs: tuple[Path, dict], source: str, target: str) -> None:
    _, results = runs
    reference = results[_reference(target)]["metrics"]["train_loss"]
    resumed = results[f"{target}-from-{source}"]["metrics"]["train_loss"]
    assert sorted(resumed, key=int) == [str(s) for s in range(5, 10)]
    for step, loss in resumed.items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])
