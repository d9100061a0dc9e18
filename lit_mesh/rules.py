"""Every cross-feature rule of MeshStrategy, collected from the units that own them: what may combine with what,
what must divide what.

A rule is data (lit_mesh/unit.py): a name, the phase that checks it, a predicate that is True when the rule is
broken, and a message with the numbers and the fix. Each unit declares its own (`RULES` in its module), a
cross-feature rule in the unit of the technique that adds the constraint; single-value checks ("tp must be >= 1",
"cp_style must be one of ...") stay beside the option they check (its dataclass's __post_init__).
This module only collects them, in one order: within a phase, the first broken rule raises.
"""

from __future__ import annotations

from typing import Optional

from lit_mesh import mesh
from lit_mesh.checkpoint import writer as checkpoint_writer
from lit_mesh.comm import rules as compression
from lit_mesh.comm import topology
from lit_mesh.parallel import activation_checkpointing, data, expert, float8, fsdp_arguments, tensor
from lit_mesh.parallel import compile as torch_compile
from lit_mesh.parallel.context import rules as context
from lit_mesh.parallel.grid import rules as grid
from lit_mesh.parallel.pipeline import rules as pipeline
from lit_mesh.training import precision
from lit_mesh.unit import Facts, Phase, Rule, divisors, enforce  # noqa: F401 - divisors, enforce re-exported

# The units in the order closest to that of the one table that held every rule before (within a phase the first
# broken rule raises, so this order decides which error a user sees first).
RULES: list[Rule] = [
    *mesh.RULES,
    *precision.RULES,
    *pipeline.RULES,  # lit_mesh/parallel/pipeline/rules.py
    *grid.RULES,  # lit_mesh/parallel/grid/rules.py
    *context.RULES,  # lit_mesh/parallel/context/rules.py
    *torch_compile.RULES,
    *float8.RULES,
    *data.RULES,
    *fsdp_arguments.RULES,
    *checkpoint_writer.RULES,
    *compression.RULES,
    *topology.RULES,
    *activation_checkpointing.RULES,
    *tensor.RULES,
    *expert.RULES,
]
RULES_BY_NAME: dict[str, Rule] = {rule.name: rule for rule in RULES}


def check(phase: Phase, facts: Facts, only: Optional[tuple[str, ...]] = None) -> None:
    """Every rule of `phase` (or only the named ones), in RULES order: the first broken one raises."""
    for rule in RULES:
        if rule.phase == phase and (only is None or rule.name in only):
            enforce(rule, facts)
