"""The `lit-mesh` command: LightningCLI's fit, validate, test and predict, our own subcommands, and those that
installed packages declare as entry points in the group "lit_mesh.commands" (the zoo's export-hf and prepare-data).

Heavy imports (Lightning, the model families, torch.distributed) happen inside the subcommand that needs them, so
that `lit-mesh --help`, `--version` and a subcommand's `--help` answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import EntryPoint, entry_points
from typing import Any

LIGHTNING_COMMANDS = {
    "fit": "train a model: `lit-mesh fit -c configs/gpt.yaml --trainer.devices=4 --trainer.strategy.init_args.tp=2`",
    "validate": "run the validation loop once (from a checkpoint with --ckpt_path)",
    "test": "run the test loop once",
    "predict": "run prediction",
}


def export_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lit-mesh export", description="Write the model weights of a checkpoint as one unsharded file."
    )
    parser.add_argument("checkpoint", help="a checkpoint written by MeshStrategy (directory) or Lightning (file)")
    parser.add_argument("output", help="where to write the state dict (torch.save)")
    parser.add_argument("--prefix", default="", help="keep only keys under this prefix, stripped (e.g. 'model')")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT if it exists (the checkpoint too)")
    args = parser.parse_args(argv)
    from lit_mesh.checkpoint import export_full_state_dict

    with refusals_reported(parser):
        out = export_full_state_dict(args.checkpoint, args.output, prefix=args.prefix, force=args.force)
    print(f"wrote {out}")


@contextmanager
def refusals_reported(parser: argparse.ArgumentParser, *more: type[Exception]) -> Iterator[None]:
    """A subcommand's bad input (a checkpoint refused, an output that would destroy something, a path that cannot
    be read or written) ends it with one message and exit status 1, not a traceback."""
    from lit_mesh.errors import CheckpointError, OutputPathError

    refused: tuple[type[Exception], ...] = (CheckpointError, OutputPathError, OSError, *more)
    try:
        yield
    except refused as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")


def plan_main(argv: list[str]) -> None:
    from lit_mesh.planner.command import main

    if main(argv):
        raise SystemExit(1)  # nothing fits, or --simulate found the estimate and the real sharding apart


# our subcommands: name -> (one line for --help, entry point taking the remaining arguments)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], None]]] = {
    "plan": (
        "the best meshes for a model family (the zoo's) on a cluster, why, and a `lit-mesh fit` config of the best",
        plan_main,
    ),
    "export": ("a checkpoint's model weights (sharded or not) as one unsharded file", export_main),
}
COMMANDS_GROUP = "lit_mesh.commands"  # entry points: name = "package.module:main", main(argv: list[str])


def plugin_commands() -> dict[str, EntryPoint]:
    """The subcommands installed packages declare (read from their metadata: nothing is imported)."""
    taken = {*LIGHTNING_COMMANDS, *COMMANDS}
    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP) if ep.name not in taken}


def overview() -> str:
    plugins = plugin_commands()
    width = max(map(len, [*LIGHTNING_COMMANDS, *COMMANDS, *plugins]))
    lines = [
        "usage: lit-mesh [--help] [--version] SUBCOMMAND ...",
        "",
        "lit-mesh: PyTorch Lightning on one N-D device mesh (DDP/FSDP/HSDP x TP/SP x CP x EP x PP).",
        "",
        "subcommands:",
    ]
    lines += [f"  {name:<{width}}  {line}" for name, line in LIGHTNING_COMMANDS.items()]
    lines += [f"  {name:<{width}}  {line}" for name, (line, _) in COMMANDS.items()]
    lines += [
        f"  {name:<{width}}  from {ep.value.split(':')[0]} (`lit-mesh {name} --help`)" for name, ep in plugins.items()
    ]
    lines += ["", "`lit-mesh SUBCOMMAND --help` lists a subcommand's options."]
    return "\n".join(lines)


def version_line() -> str:
    from importlib.metadata import version

    import lit_mesh

    return f"lit-mesh {lit_mesh.__version__} (torch {version('torch')}, lightning {version('lightning')})"


def run(argv: list[str], from_command_line: bool = False) -> Any:
    """Run `lit-mesh ARGV` in this process; returns the LightningCLI (its trainer and model), None otherwise.

    from_command_line: argv is sys.argv[1:], so LightningCLI reads sys.argv itself (given `args` as well, it
    warns that they may disagree).
    """
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        return None
    if argv[0] == "--version":
        print(version_line())
        return None
    if argv[0] in COMMANDS:
        COMMANDS[argv[0]][1](argv[1:])
        return None
    plugin = plugin_commands().get(argv[0])
    if plugin is not None:
        plugin.load()(argv[1:])
        return None
    if argv[0] not in LIGHTNING_COMMANDS and not argv[0].startswith("-"):
        raise SystemExit(f"lit-mesh: unknown subcommand {argv[0]!r}\n\n{overview()}")
    return lightning_cli(None if from_command_line else argv, argv[0] if argv[0] in LIGHTNING_COMMANDS else None)


def lightning_cli(args: list[str] | None, subcommand: str | None = None) -> Any:
    """LightningCLI with lit-mesh's callbacks; `subcommand` (fit, validate, ...): only its parser is built (building
    all four costs a third of a small run's start)."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

    import lit_mesh  # noqa: F401  (registers the "mesh" strategy)
    from lit_mesh.checkpoint.resume import resolve_ckpt_path
    from lit_mesh.planner.families import import_cli_modules

    import_cli_modules()  # the model families' modules (the zoo's), so that short class paths (--model=GPTModule) resolve

    class KeepConfigCallback(SaveConfigCallback):
        """Saves the run's config as LightningCLI does, never over another file: a config.yaml that holds
        another config (the user's own, another run's) is kept, and this one is written as config-N.yaml."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if not self.already_saved and self.save_to_log_dir:
                log_dir = trainer.log_dir  # broadcasts the directory
                name = None
                if trainer.is_global_zero:
                    name = free_config_name(
                        log_dir, self.config_filename, self.parser.dump(self.config, skip_none=False)
                    )
                self.config_filename = trainer.strategy.broadcast(name)
            super().setup(trainer, pl_module, stage)

    class MeshCLI(LightningCLI):
        @staticmethod
        def subcommands() -> dict[str, set[str]]:
            every = LightningCLI.subcommands()
            return {subcommand: every[subcommand]} if subcommand in every else every

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            trainer = super().instantiate_trainer(**kwargs)
            drop_monitors_without_logger(trainer)
            return trainer

        def before_fit(self) -> None:  # LightningCLI calls before_<subcommand> when a subclass defines it
            # after a restart (torchrun --max-restarts, SLURM requeue): the newest complete checkpoint
            config = self.config_init[self.subcommand]
            config["ckpt_path"] = resolve_ckpt_path(self.trainer, config.get("ckpt_path"))

    return MeshCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=KeepConfigCallback,
        save_config_kwargs={"overwrite": True},  # only over a file holding this very config (KeepConfigCallback)
        args=args,
    )


def drop_monitors_without_logger(trainer: Any) -> None:
    """`--trainer.logger=false` with a recipe's LearningRateMonitor (or DeviceStatsMonitor): Lightning's monitors
    refuse to start without a logger; with nothing to log to they have nothing to do, so the run goes on without them
    (lit-mesh's own monitors skip their logging themselves)."""
    from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor

    if not trainer.loggers:
        trainer.callbacks = [
            c for c in trainer.callbacks if not isinstance(c, (LearningRateMonitor, DeviceStatsMonitor))
        ]


def free_config_name(log_dir: str, name: str, config: str) -> str:
    """`name` (config.yaml) unless it exists with other content; else the first config-N.yaml free or holding
    `config` (a resumed run finds its own)."""
    stem, dot, suffix = name.rpartition(".") if "." in name else (name, "", "")
    for n in range(10_000):
        candidate = name if n == 0 else f"{stem}-{n}{dot}{suffix}"
        path = os.path.join(log_dir, candidate)
        if not os.path.exists(path):
            return candidate
        try:
            with open(path, encoding="utf-8") as file:
                if file.read() == config:
                    return candidate
        except (OSError, UnicodeDecodeError):
            continue
    raise SystemExit(f"lit-mesh: {log_dir!r} holds 10000 config-N.yaml files; clear it or set another log dir")


def main() -> None:
    """The console script (its return value would become the exit status)."""
    try:
        run(sys.argv[1:], from_command_line=True)
    except Exception as error:
        end_on_known_error(error)
        raise
    if close_process_groups():
        # the run is complete (loggers and checkpoints finalised at teardown); under load torch 2.13 + gloo can
        # still abort in interpreter shutdown ("terminate called without an active exception", a joinable native
        # thread destroyed), turning a finished run into exit -6: leave without the C++ teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def end_on_known_error(error: Exception) -> None:
    """A checkpoint error ends every rank with one message; a hung collective ends this rank at once; any other error
    returns (to be raised). The error classes are imported here, when something was raised: they load torch and
    Lightning, which `lit-mesh --help` must not wait for."""
    from lit_mesh.checkpoint import CheckpointError
    from lit_mesh.reliability.hangs import CollectiveHangError

    if isinstance(error, CheckpointError):
        exit_once(error)
    if isinstance(error, CollectiveHangError):  # every rank says it; no barrier, no teardown: a peer is stuck
        print(f"lit-mesh: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        os._exit(1)


def exit_once(error: Exception) -> None:
    """End every rank with one message for the run (rank 0's), not one traceback per rank; exit status 1."""
    import torch.distributed as dist

    started = dist.is_available() and dist.is_initialized()
    if not started or dist.get_rank() == 0:
        print(f"lit-mesh: {error}", file=sys.stderr, flush=True)
    if started:
        dist.barrier()  # no rank exits (and gets the others killed by torchrun) before the message is out
    close_process_groups()
    raise SystemExit(1)


def close_process_groups() -> bool:
    """Destroy the process groups before the interpreter exits (gloo's threads torn down during interpreter
    shutdown can abort a finished run); True if there were any."""
    if "torch" not in sys.modules:  # a --help or plan run never started torch.distributed
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


if __name__ == "__main__":
    main()
