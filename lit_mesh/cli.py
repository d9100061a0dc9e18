"""The `lit-mesh` command: LightningCLI (fit, validate, test, predict) plus `export`, `export-hf`, `plan` and
`prepare-data`."""

from __future__ import annotations

import argparse
import sys

import torch.distributed as dist

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lit_mesh  # noqa: F401  (registers the "mesh" strategy)
import zoo  # noqa: F401  (so short class paths of zoo modules resolve)
from lit_mesh.checkpoint import export_full_state_dict


def export_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lit-mesh export", description="Write the model weights of a checkpoint as one unsharded file."
    )
    parser.add_argument("checkpoint", help="a checkpoint written by MeshStrategy (directory) or Lightning (file)")
    parser.add_argument("output", help="where to write the state dict (torch.save)")
    parser.add_argument("--prefix", default="", help="keep only keys under this prefix, stripped (e.g. 'model')")
    args = parser.parse_args(argv)
    out = export_full_state_dict(args.checkpoint, args.output, prefix=args.prefix)
    print(f"wrote {out}")


def export_hf_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lit-mesh export-hf",
        description="Write the model of a checkpoint as a transformers directory (config.json + model.safetensors)"
        " that from_pretrained loads.",
    )
    parser.add_argument("checkpoint", help="a checkpoint written by `lit-mesh fit` (sharded directory or one file)")
    parser.add_argument("output", help="the directory to write")
    parser.add_argument("--prefix", default="model", help="the LightningModule attribute holding the model")
    args = parser.parse_args(argv)
    from zoo.convert import export_hf

    print(f"wrote {export_hf(args.checkpoint, args.output, prefix=args.prefix)}")


def run(argv: list[str]) -> LightningCLI | None:
    """Run `lit-mesh ARGV` in this process; returns the LightningCLI (its trainer and model), None for the other
    commands."""
    if argv[:1] == ["export"]:
        export_main(argv[1:])
        return None
    if argv[:1] == ["export-hf"]:
        export_hf_main(argv[1:])
        return None
    if argv[:1] == ["prepare-data"]:
        from zoo.prepare_data import main as prepare_main

        prepare_main(argv[1:])
        return None
    if argv[:1] == ["plan"]:
        from lit_mesh.planner.command import main as plan_main

        if plan_main(argv[1:]):
            raise SystemExit(1)  # --simulate found the estimate and the real sharding apart
        return None
    return LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )


def main() -> None:
    """The console script (its return value would become the exit status)."""
    run(sys.argv[1:])
    close_process_groups()


def close_process_groups() -> None:
    """Destroy the process groups before the interpreter exits: gloo's threads torn down during interpreter
    shutdown can abort a finished run ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
