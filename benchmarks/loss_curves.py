"""Loss curves of every mesh layout on one plot: the zoo GPT trained through `lit-mesh fit` (configs/gpt.yaml,
fp32, the same global batches) on one device and on each layout, one torchrun launch per world size (the
test suite's tests/workers/cli_runs.py). Prints, per layout, the largest relative gap to the single-device
loss over the steps; writes the picture.

    python benchmarks/loss_curves.py
    python benchmarks/loss_curves.py --steps 20 --png loss.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import _common as C  # noqa: N812 (puts the repo on sys.path)

from lit_mesh.extras import pyplot  # noqa: E402
from tests.launch import cli_runs  # noqa: E402

S = "--trainer.strategy.init_args."
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "fsdp2": (2, [f"{S}dp=2"]),
    "ddp2": (2, [f"{S}dp_replicate=2"]),
    "tp2": (2, [f"{S}tp=2"]),
    "cp2": (2, [f"{S}cp=2"]),
    "pp2": (2, [f"{S}pp=2", f"{S}pp_microbatches=2"]),
    "fsdp2_tp2": (4, [f"{S}tp=2"]),
    "hsdp2x2": (4, [f"{S}dp_replicate=2", f"{S}dp_shard=2"]),
}
GOAL = 1e-4
DEFAULT_PNG = C.REPO / "benchmarks" / "figures" / "loss_curves.png"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--png", default=str(DEFAULT_PNG))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each launch")
    return p.parse_args(argv)


def plot(curves: dict[str, list[float]], path: Path) -> None:
    plt = pyplot()

    fig, (ax, gap) = plt.subplots(1, 2, figsize=(10, 4))
    reference = curves["single"]
    for i, (name, losses) in enumerate(curves.items()):
        steps = range(1, len(losses) + 1)
        ax.plot(steps, losses, marker="o", markersize=3, linewidth=1, label=name, linestyle="-" if i % 2 else "--")
        if name != "single":
            gap.plot(
                steps, [abs(a - b) / abs(b) for a, b in zip(losses, reference)], marker="o", markersize=3, label=name
            )
    ax.set(xlabel="step", ylabel="train_loss", title="zoo GPT (tiny, fp32): every layout")
    gap.axhline(GOAL, color="black", linestyle="--", label="1e-4")
    gap.set(xlabel="step", ylabel="|loss - single| / single", yscale="symlog", title="gap to one device")
    gap.set_yscale("symlog", linthresh=1e-7)
    ax.legend(fontsize=7)
    gap.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    names = ["single", *[n for n in args.layouts if n != "single"]]
    common = [
        f"--trainer.max_steps={args.steps}",
        "--trainer.log_every_n_steps=1",
        "--trainer.logger=CSVLogger",
        "--data.global_batch_size=8",
        "--seed_everything=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.limit_val_batches=0",
    ]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in sorted({LAYOUTS[n][0] for n in names}):
            runs = [
                {
                    "name": n,
                    "args": [
                        "-c",
                        str(C.REPO / "configs" / "gpt.yaml"),
                        f"--trainer.devices={nproc}",
                        *common,
                        *LAYOUTS[n][1],
                    ],
                }
                for n in names
                if LAYOUTS[n][0] == nproc
            ]
            print(f"launching {nproc} rank(s): {[r['name'] for r in runs]}", file=sys.stderr, flush=True)
            results.update(cli_runs(nproc, Path(tmp), runs, timeout=args.timeout))
    curves = {
        n: [v for _, v in sorted(results[n]["metrics"]["train_loss"].items(), key=lambda kv: int(kv[0]))] for n in names
    }
    reference = curves["single"]
    gaps = {n: max(abs(a - b) / abs(b) for a, b in zip(curves[n], reference)) for n in names if n != "single"}
    plot(curves, Path(args.png))
    C.print_result(
        {
            "benchmark": "loss_curves",
            "png": str(args.png),
            "losses": curves,
            "max_relative_gap": gaps,
            "goal": f"every layout within {GOAL:g} of the single-device loss at every step",
            "goal_met": all(len(curves[n]) == args.steps for n in names) and all(g <= GOAL for g in gaps.values()),
            "config": {
                "recipe": "configs/gpt.yaml (tiny)",
                "global_batch_size": 8,
                "steps": args.steps,
                "precision": "32-true",
                "layouts": {n: LAYOUTS[n] for n in names},
                **C.environment(),
            },
        }
    )


if __name__ == "__main__":
    main(sys.argv[1:])
