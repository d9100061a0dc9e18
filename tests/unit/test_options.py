"""One source of truth for MeshStrategy's arguments: the units' options dataclasses (lit_mesh/options.py's
ARGUMENTS). MeshStrategy.__init__ repeats each name, type and default (IDEs, LightningCLI): these tests keep it
equal to the table, and check that the help LightningCLI prints is the table's."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from typing import get_type_hints

import pytest

from lit_mesh import MeshStrategy
from lit_mesh.comm.options import CompressionOptions
from lit_mesh.comm.topology import Topology
from lit_mesh.options import ARGUMENTS, MeshOptions, build_options


def _parameters() -> dict[str, inspect.Parameter]:
    # **kwargs: FSDPStrategy's FSDP1 keyword arguments (lit_mesh/parallel/fsdp_arguments.py), no options of ours
    parameters = inspect.signature(MeshStrategy.__init__).parameters.items()
    return {name: p for name, p in parameters if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def _where() -> str:
    return f"lit_mesh/strategy.py:{inspect.getsourcelines(MeshStrategy.__init__)[1]} (MeshStrategy.__init__)"


def test_signature_names_every_option_once() -> None:
    names = set(_parameters())
    missing = [a for name, a in ARGUMENTS.items() if name not in names]
    assert not missing, (
        "add to the signature at "
        + _where()
        + ":\n"
        + "\n".join(f"    {a.name}: {a.annotation} = {a.default!r}," for a in missing)
    )
    extra = sorted(names - set(ARGUMENTS))
    assert not extra, (
        f"{extra} in the signature at {_where()}: define them as option() fields of their unit's dataclass"
    )


@pytest.mark.parametrize("name", list(ARGUMENTS))
def test_signature_annotation_and_default_equal_the_option(name: str) -> None:
    argument, parameter = ARGUMENTS[name], _parameters()[name]
    annotation = get_type_hints(MeshStrategy.__init__)[name]
    where = f"{_where()}, argument {name!r}; its option: {argument.group}.{argument.field or name}"
    assert annotation == argument.annotation, (
        f"{where}: the signature says {annotation}, the option {argument.annotation}"
    )
    assert parameter.default == argument.default, f"{where}: default {parameter.default!r} != {argument.default!r}"


def test_every_field_of_every_group_is_an_argument() -> None:
    """A field added to a group without option() would neither be an argument nor documented."""
    for argument in ARGUMENTS.values():
        group = next(f for f in fields(MeshOptions) if f.name == argument.group)
        assert argument.field is None or argument.field in {f.name for f in fields(type(group.default))}
    assert len({(a.group, a.field) for a in ARGUMENTS.values()}) == len(ARGUMENTS)


def test_docstring_lists_every_argument_with_its_doc() -> None:
    doc = " ".join(inspect.getdoc(MeshStrategy).split())
    for argument in ARGUMENTS.values():
        assert f"{argument.name}: {' '.join(argument.doc.split())}" in doc


def test_lightning_cli_help_shows_every_argument_with_its_doc(capsys: pytest.CaptureFixture[str]) -> None:
    from lit_mesh.cli import run

    with pytest.raises(SystemExit):
        run(["fit", "--trainer.strategy.help", "lit_mesh.MeshStrategy"])
    shown = " ".join(capsys.readouterr().out.split())
    shown = shown[shown.index("Help for --trainer.strategy.help") :]  # past the usage line
    for argument in ARGUMENTS.values():
        doc = " ".join(argument.doc.split())
        start = shown.find(f"--trainer.strategy.{argument.name} ")
        assert start >= 0, f"--trainer.strategy.{argument.name} is not in LightningCLI's help"
        # the flag, its metavar (and an append alias for lists), then the help text
        assert doc in shown[start : start + len(doc) + 160], (
            f"--trainer.strategy.{argument.name}: its help is not {doc!r}"
        )


def test_build_options_converts_in_the_groups() -> None:
    options = build_options(
        grad_compression="fp16", topology={"nodes": 1}, compile_blocks=True, compile_backend="aot_eager"
    )
    assert options.communication.compression == CompressionOptions(mode="fp16")
    assert options.communication.topology == Topology(nodes=1)
    assert options.compile.backend == "aot_eager"
    assert build_options(tp_mode="2d", tp=4).mesh.sequence_parallel is False  # its default follows tp_mode
    assert build_options(compile_backend="aot_eager").compile.backend is None  # compile_blocks=False
    assert build_options(tp=2).mesh.sequence_parallel is True
    with pytest.raises(TypeError, match=re.escape("unknown MeshStrategy arguments ['tensor_parallel']")):
        build_options(tensor_parallel=2)
