"""What a technique unit declares: its rules (`Rule`, judged on the `Facts` a phase knows) and its options
(dataclass fields made with `option`, which carry the flat MeshStrategy argument and its help text).

Every unit (lit_mesh/parallel/*, lit_mesh/comm, ...) builds on this module alone, so that lit_mesh/rules.py can
collect the units' rules and lit_mesh/options.py their options without an import cycle. The phases, each checked
in one place:
  "init"    MeshStrategy.__init__ (lit_mesh.options.build_options): the arguments alone, in the user's process;
  "layout"  the degrees against the world size, once resolved;
  "launch"  MeshStrategy._configure_launcher, before any process spawns: the resolved layout, the precision
            plugin and the topology;
  "setup"   lit_mesh.parallel.apply.parallelize: the model (its plans, or its own parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_mesh.errors import MeshConfigError

Phase = Literal["init", "layout", "launch", "setup"]


@dataclass
class Facts:
    """What a phase knows. Fields a phase does not know yet stay None (empty for `owners`)."""

    degrees: dict[str, Any] = field(default_factory=dict)  # dp, dp_replicate, dp_shard, tp, cp, pp, ep as given
    options: Any = None  # lit_mesh.options.MeshOptions (init, launch, setup)
    world_size: Optional[int] = None  # layout, launch
    layout: Any = None  # lit_mesh.mesh.MeshLayout, resolved (layout: once resolved; launch, setup)
    precision: Optional[str] = None  # launch
    precision_plugin: Any = None  # launch: the Trainer's precision plugin (its loss scaler)
    device_type: Optional[str] = None  # launch: "cpu", "cuda", ...
    process_group_backend: Optional[str] = None  # launch: "gloo", "nccl", ...
    topology: Any = None  # lit_mesh.comm.topology.Topology (launch)
    model_name: str = ""  # the LightningModule's class (setup)
    root: Any = None  # the LightningModule itself (setup)
    owners: list[Any] = field(default_factory=list)  # plan owners found in the model (setup)
    self_parallelised: bool = False  # configure_model applied parallelism itself (setup)
    blocks: list[str] = field(default_factory=list)  # a model without a plan: its blocks, found or named (setup)

    def degree(self, name: str) -> Any:
        """A resolved degree where the layout is known, else the given one."""
        return getattr(self.layout, name) if self.layout is not None else self.degrees.get(name)


@dataclass(frozen=True)
class Rule:
    name: str
    phase: Phase
    broken: Callable[[Facts], bool]
    message: Callable[[Facts], str]
    error: type[Exception] = MeshConfigError
    warn_only: bool = False  # a warning, not an error (the run works, only slower or without a feature)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enforce(rule: Rule, facts: Facts) -> None:
    """Raise the rule's error (or warn, for a warning rule) where `facts` break it."""
    if rule.broken(facts):
        if rule.warn_only:
            rank_zero_warn(rule.message(facts))
        else:
            raise rule.error(rule.message(facts))


def option(default: Any, *, doc: str, arg: Optional[str] = None, accepts: Any = None) -> Any:
    """A field of a unit's options dataclass. `arg`: its flat MeshStrategy argument (default: the field's name);
    `doc`: the argument's help text (MeshStrategy's docstring, which LightningCLI reads, is built from it);
    `accepts`: the argument's type where the dataclass converts what it is given (e.g. a mode name into
    CompressionOptions, in its __post_init__), else the field's annotation."""
    return field(default=default, metadata={"doc": doc, "arg": arg, "accepts": accepts})
