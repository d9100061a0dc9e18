"""MeshOptions: MeshStrategy's arguments, grouped by the unit that owns them, checked, frozen.

Each argument is defined once, as a field of its unit's options dataclass made with `lit_mesh.unit.option`: its
name (the field's, or `arg`), type (the annotation, or `accepts`), default and help text. ARGUMENTS is the table
read from those fields; MeshStrategy's docstring (which LightningCLI reads) is built from it, and
tests/unit/test_options.py checks MeshStrategy.__init__'s flat, typed signature against it. `build_options` turns
the flat arguments into the groups (each group checks its own values, e.g. in __post_init__), then checks the
"init" rules of every unit (lit_mesh/rules.py). Everything downstream (parallelize, the components) reads the groups.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Optional, get_type_hints

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lit_mesh.checkpoint.writer import CheckpointOptions
from lit_mesh.comm.options import CommunicationOptions
from lit_mesh.mesh import MeshDegrees
from lit_mesh.parallel.activation_checkpointing import MemoryOptions
from lit_mesh.parallel.compile import CompileOptions
from lit_mesh.parallel.context import ContextOptions
from lit_mesh.parallel.data import DataParallelOptions
from lit_mesh.parallel.expert import ExpertOptions
from lit_mesh.parallel.float8 import Float8Options
from lit_mesh.parallel.fsdp_arguments import FSDP1_KEYWORDS, FSDPArguments, check_fsdp1_keywords, resolve
from lit_mesh.parallel.fsdp_arguments import RULES as FSDP_ARGUMENT_RULES
from lit_mesh.parallel.grid import TPMode, check_tp_mode
from lit_mesh.parallel.pipeline.schedules import PipelineSettings, check_pipeline_settings
from lit_mesh.reliability.replan import WorldChangeOptions
from lit_mesh.rules import RULES, Facts, check
from lit_mesh.unit import option

__all__ = [  # the groups, importable from here as before
    "CheckpointOptions",
    "CommunicationOptions",
    "CompileOptions",
    "ContextOptions",
    "DataParallelOptions",
    "ExpertOptions",
    "FSDPArguments",
    "Float8Options",
    "LaunchOptions",
    "MemoryOptions",
    "MeshDegrees",
    "MeshOptions",
    "PipelineSettings",
    "TensorOptions",
    "WorldChangeOptions",
    "ARGUMENTS",
    "Argument",
    "args_docstring",
    "build_options",
]


@dataclass(frozen=True)
class TensorOptions:
    mode: TPMode = option(
        "1d",
        doc='how the tp ranks split the model: "1d" (Megatron-style column/row split, the default), "2d" (SUMMA on a q'
        ' x q grid, tp = q * q), "2.5d" (Tesseract: tp = d * q * q with tp_depth=d) or "3d" (tp = q^3). The grid'
        " modes split weights and activations in blocks; they combine with dp_replicate (DDP) only (no FSDP, pp, cp,"
        " ep, sequence_parallel, compile, activation checkpointing or grad_compression). See"
        " lit_mesh/parallel/grid/.",
        arg="tp_mode",
    )
    depth: Optional[int] = option(
        None,
        doc='the depth d of tp_mode="2.5d" (the weight blocks are replicated d times, the batch split d times).',
        arg="tp_depth",
    )


@dataclass(frozen=True)
class LaunchOptions:
    """ModelParallelStrategy's own arguments (MeshStrategy hands them on)."""

    process_group_backend: Optional[str] = option(None, doc='"gloo", "nccl", ...; default from the device.')
    timeout: Optional[timedelta] = option(default_pg_timeout, doc="timeout of collectives.")


@dataclass(frozen=True)
class MeshOptions:
    """Everything the user chose, by the unit that owns it. A field is a group (a unit's options dataclass) or one
    option of its own."""

    mesh: MeshDegrees = MeshDegrees()
    data: DataParallelOptions = DataParallelOptions()
    tensor: TensorOptions = TensorOptions()
    pipeline: PipelineSettings = PipelineSettings()
    context: ContextOptions = ContextOptions()
    expert: ExpertOptions = ExpertOptions()
    memory: MemoryOptions = MemoryOptions()
    compile: CompileOptions = CompileOptions()
    float8: Float8Options = Float8Options()
    communication: CommunicationOptions = CommunicationOptions()
    checkpoint: CheckpointOptions = CheckpointOptions()
    stop_on_nonfinite_loss: bool = option(
        True,
        doc="stop with the step and the ranks when a training loss is NaN or infinite; every rank stops together (one"
        " tiny all-reduce on logging steps, before saves and at the end; nothing on the other steps: see"
        " lit_mesh/reliability/nonfinite.py).",
    )
    world: WorldChangeOptions = WorldChangeOptions()
    launch: LaunchOptions = LaunchOptions()
    fsdp: FSDPArguments = FSDPArguments()  # Lightning FSDPStrategy's names (lit_mesh/parallel/fsdp_arguments.py)

    def __post_init__(self) -> None:
        if self.mesh.sequence_parallel is None:  # SP splits 1-D TP's sequence; the grid schemes split the batch
            object.__setattr__(self, "mesh", replace(self.mesh, sequence_parallel=self.tensor.mode == "1d"))


@dataclass(frozen=True)
class Argument:
    """One flat MeshStrategy argument, as its unit's field defines it."""

    name: str  # MeshStrategy's argument
    group: str  # the MeshOptions field that holds it
    field: Optional[str]  # its field in the group's dataclass; None: the MeshOptions field is the option itself
    annotation: Any
    default: Any
    doc: str


def _tensor_options(mode: TPMode, depth: Optional[int]) -> TensorOptions:
    check_tp_mode(mode, depth)
    return TensorOptions(mode, depth)


# the groups whose dataclass does not check its own values (yet: the pipeline and grid-TP units): the function
# that checks them and builds it
_BUILDERS: dict[type, Callable[..., Any]] = {
    PipelineSettings: check_pipeline_settings,
    TensorOptions: _tensor_options,
}


def _arguments() -> dict[str, Argument]:
    table: dict[str, Argument] = {}
    for group in fields(MeshOptions):
        if "doc" in group.metadata:
            options, hints, in_group = [group], get_type_hints(MeshOptions), False
        else:
            cls = get_type_hints(MeshOptions)[group.name]
            options, hints, in_group = list(fields(cls)), get_type_hints(cls), True
        for f in options:
            if "doc" not in f.metadata:
                raise TypeError(f"{group.name}.{f.name}: every field of an options group is made with option(doc=...)")
            name = f.metadata["arg"] or f.name
            annotation = f.metadata["accepts"] if f.metadata["accepts"] is not None else hints[f.name]
            table[name] = Argument(
                name, group.name, f.name if in_group else None, annotation, f.default, f.metadata["doc"]
            )
    return table


ARGUMENTS: dict[str, Argument] = _arguments()


def args_docstring(indent: str = "    ", width: int = 120) -> str:
    """The "Args:" section of MeshStrategy's docstring, one entry per argument, in the table's order."""
    lines = [f"{indent}Args:"]
    for argument in ARGUMENTS.values():
        lines += textwrap.wrap(
            f"{argument.name}: {argument.doc}",
            width,
            initial_indent=indent * 2,
            subsequent_indent=indent * 3,
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def build_options(**given: Any) -> MeshOptions:
    """MeshStrategy's flat arguments (any of ARGUMENTS; the rest take their defaults) -> MeshOptions; raises what
    needs no world size, in the user's process."""
    check_fsdp1_keywords(given)  # FSDPStrategy's **kwargs: FSDP1's own arguments
    unknown = sorted(set(given) - set(ARGUMENTS) - set(FSDP1_KEYWORDS))
    if unknown:
        raise TypeError(f"unknown MeshStrategy arguments {unknown}; the arguments are {list(ARGUMENTS)}")
    values: dict[str, Any] = {}
    for group in fields(MeshOptions):
        arguments = [a for a in ARGUMENTS.values() if a.group == group.name]
        if arguments[0].field is None:
            values[group.name] = given.get(arguments[0].name, arguments[0].default)
        else:
            cls = type(group.default)
            kwargs = {str(a.field): given.get(a.name, a.default) for a in arguments}
            values[group.name] = _BUILDERS.get(cls, cls)(**kwargs)
    options = MeshOptions(**values)
    check("init", Facts(degrees=options.mesh.degrees(), options=options))  # as given: FSDPStrategy's names vs ours
    resolved = resolve(options)
    if resolved != options:  # what FSDPStrategy's names mean, against the other units' rules
        others = tuple(rule.name for rule in RULES if rule.phase == "init" and rule not in FSDP_ARGUMENT_RULES)
        check("init", Facts(degrees=resolved.mesh.degrees(), options=resolved), only=others)
    return resolved
