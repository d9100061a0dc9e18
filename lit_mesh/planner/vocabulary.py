"""The planner's vocabularies, free of torch so that `lit-mesh plan --help` answers without importing it."""

from __future__ import annotations

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the mesh dims, outermost first

# bytes per element of: parameters, gradients, AdamW state (two moments), activations, all-gathered parameters
PRECISION_BYTES = {
    "32-true": dict(param=4, grad=4, optimizer=8, activation=4, gather=4),
    "bf16-mixed": dict(param=4, grad=4, optimizer=8, activation=2, gather=2),  # fp32 masters, bf16 compute
    "bf16-true": dict(param=2, grad=2, optimizer=4, activation=2, gather=2),
}
# MeshStrategy(float8=...)'s recipes (lit_mesh/parallel/float8.py FLOAT8_RECIPES, which imports torch; a unit test
# keeps the two equal)
FLOAT8_RECIPES = ("tensorwise", "rowwise")
# activation checkpointing per block; "full/2": full on every 2nd block of the model (ac_every_n_blocks=2), half the
# recompute of "full" for about half the activations of "none"; "full/2+selective": the blocks between those
# selective (ac_other_blocks="selective"), between "selective" and "full" in both
AC_MODES = ("none", "selective", "full/2+selective", "full/2", "full")


def ac_mode(ac: str) -> str:
    """MeshStrategy's activation_checkpointing of a planner AC mode ("full/2" -> "full")."""
    return ac.partition("/")[0]


def ac_every(ac: str) -> int:
    """MeshStrategy's ac_every_n_blocks of a planner AC mode ("full/2" -> 2; "none" -> 1)."""
    return int(ac.partition("+")[0].partition("/")[2] or 1)


def ac_others(ac: str) -> str:
    """MeshStrategy's ac_other_blocks of a planner AC mode: what the blocks ac_every_n_blocks leaves out run
    ("full/2+selective" -> "selective"; else "none")."""
    return ac.partition("+")[2] or "none"
