"""Damaged checkpoints, probed in the processes torchrun started (issue #25, item 6).

Usage: torchrun --standalone --nproc_per_node=2 tests/workers/checkpoint_probes.py OUT_DIR GPT_ARGS_JSON MOE_ARGS_JSON
Trains 4 steps (step=2.ckpt, step=4.ckpt), damages copies of step=4.ckpt, resumes from each (and exports each on
rank 0), recording the error and whether the directory changed in OUT_DIR/probes.json; then resumes once more
through `lit-mesh`'s console entry point, which must end both ranks with a single message and exit status 1.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from lit_mesh.checkpoint import export_full_state_dict
from lit_mesh.cli import main, run
from tests.evil_checkpoints import corrupt_shard, poison_entry, poison_layout


def fingerprint(directory: Path) -> dict[str, str]:
    return {
        str(f.relative_to(directory)): hashlib.sha1(f.read_bytes()).hexdigest()
        for f in sorted(directory.rglob("*"))
        if f.is_file()
    }


PROBES = ("missing_shard", "truncated_shard", "unreadable_layout", "evil_layout", "evil_entry", "corrupt_shard")
EVIL_SIBLING = "evil_sibling"  # step=4.ckpt misses a shard, step=2.ckpt (the sibling) is crafted to run code


def damage(source: Path, out: Path) -> dict[str, Path]:
    """Copies of the run's checkpoint directory, each with step=4.ckpt damaged one way (step=2.ckpt intact), or
    crafted to run code (issue #40: the payload would create out/payload-ran)."""
    probes = {}
    for name in (*PROBES, EVIL_SIBLING):
        shutil.copytree(source, out / name)
        probes[name] = out / name / "step=4.ckpt"
    (probes["missing_shard"] / "__1_0.distcp").unlink()
    shard = probes["truncated_shard"] / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (probes["unreadable_layout"] / ".metadata").write_bytes(b"not a layout")
    poison_layout(probes["evil_layout"], out / "payload-ran")
    poison_entry(probes["evil_entry"], out / "payload-ran")
    corrupt_shard(probes["corrupt_shard"])
    (probes[EVIL_SIBLING] / "__1_0.distcp").unlink()
    poison_layout(out / EVIL_SIBLING / "step=2.ckpt", out / "payload-ran")
    return probes


if __name__ == "__main__":
    out, gpt_args, moe_args = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    run(
        [
            "fit",
            *gpt_args,
            "--trainer.max_steps=4",
            f"--trainer.logger.save_dir={out / 'train'}",
            "--trainer.callbacks+=ModelCheckpoint",
            f"--trainer.callbacks.dirpath={out / 'ckpt'}",
            "--trainer.callbacks.every_n_train_steps=2",
            "--trainer.callbacks.save_top_k=-1",
            "--trainer.callbacks.filename={step}",
        ]
    )
    if dist.get_rank() == 0:
        probes = damage(out / "ckpt", out)
    dist.barrier()
    probes = {name: out / name / "step=4.ckpt" for name in (*PROBES, EVIL_SIBLING)}
    resumes = {name: ["fit", *gpt_args, f"--ckpt_path={path}"] for name, path in probes.items()}
    resumes["gpt_into_moe"] = ["fit", *moe_args, f"--ckpt_path={out / 'ckpt' / 'step=4.ckpt'}"]
    # validate reads --ckpt_path through the same loader
    resumes["validate_evil_entry"] = ["validate", *gpt_args, f"--ckpt_path={probes['evil_entry']}"]
    resumes["validate_evil_layout"] = ["validate", *gpt_args, f"--ckpt_path={probes['evil_layout']}"]
    results = {}
    for name, args in resumes.items():
        directory = Path(args[-1].split("=", 1)[1]).parent
        before = fingerprint(directory)
        dist.barrier()
        try:
            fit_only = ["--trainer.max_steps=6"] if args[0] == "fit" else []
            run(
                [
                    *args,
                    *fit_only,
                    "--trainer.enable_checkpointing=false",
                    f"--trainer.logger.save_dir={out / 'logs' / name}",
                ]
            )
            results[name] = {"resume": "no error"}
        except Exception as error:  # noqa: BLE001 - recorded for the test to judge
            results[name] = {"resume": f"{type(error).__name__}: {error}"}
        if dist.get_rank() == 0 and name in probes:
            try:
                export_full_state_dict(probes[name], out / f"{name}.pt")
                results[name]["export"] = "no error"
            except Exception as error:  # noqa: BLE001
                results[name]["export"] = f"{type(error).__name__}: {error}"
        dist.barrier()
        results[name]["unchanged"] = fingerprint(directory) == before
    # disk full while writing step=4.ckpt on rank 1: the save fails on every rank, step=2.ckpt stays as it was
    try:
        run(
            [
                "fit",
                *gpt_args,
                "--trainer.max_steps=4",
                f"--trainer.logger.save_dir={out / 'logs' / 'disk_full'}",
                "--trainer.callbacks+=ModelCheckpoint",
                f"--trainer.callbacks.dirpath={out / 'full_disk'}",
                "--trainer.callbacks.every_n_train_steps=2",
                "--trainer.callbacks.save_top_k=-1",
                "--trainer.callbacks.filename={step}",
                "--trainer.callbacks+=lit_mesh.FaultInjector",
                "--trainer.callbacks.fault=disk_full",
                "--trainer.callbacks.step=3",
                "--trainer.callbacks.rank=1",
            ]
        )
        results["disk_full"] = {"save": "no error"}
    except Exception as error:  # noqa: BLE001
        results["disk_full"] = {"save": f"{type(error).__name__}: {error}"}
    results["payload_ran"] = (out / "payload-ran").exists()
    dist.barrier()
    results["disk_full"]["left"] = sorted(p.name for p in (out / "full_disk").iterdir())
    if dist.get_rank() == 0:
        (out / "probes.json").write_text(json.dumps(results))
    dist.barrier()
    sys.argv = [
        "lit-mesh",
        "fit",
        *gpt_args,
        f"--ckpt_path={probes['missing_shard']}",
        "--trainer.max_steps=6",
        "--trainer.enable_checkpointing=false",
        f"--trainer.logger.save_dir={out / 'logs' / 'console'}",
    ]
    main()
