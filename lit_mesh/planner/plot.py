"""Pictures of a plan: the mesh on the nodes (one panel per parallel dim, ranks coloured by their group of that
dim) and the per-rank memory breakdown of the best candidates. PNGs through matplotlib's Agg backend."""

from __future__ import annotations

from pathlib import Path

from lit_mesh.extras import pyplot
from lit_mesh.mesh import MeshLayout
from lit_mesh.planner.hardware import GIB, Hardware
from lit_mesh.planner.memory import coords_of
from lit_mesh.planner.search import DIMS, Candidate

MAX_NODES_DRAWN = 32  # a 128-node mesh repeats the same pattern; draw the first nodes only


def group_of(rank: int, layout: MeshLayout, dim: str) -> int:
    """Which group of `dim` a rank belongs to: its coordinates in every other dim, as one number."""
    c = coords_of(rank, layout)
    index = 0
    for d in DIMS:
        if d != dim:
            index = index * getattr(layout, d) + getattr(c, d)
    return index


def plot_mesh(layout: MeshLayout, hw: Hardware, path: str | Path) -> Path:
    plt = pyplot()
    dims = [d for d in DIMS if getattr(layout, d) > 1] or ["dp_shard"]
    nodes = min(hw.nodes, MAX_NODES_DRAWN)
    fig, axes = plt.subplots(
        1, len(dims), figsize=(1.2 + 0.45 * hw.devices_per_node * len(dims), 1 + 0.3 * nodes), squeeze=False
    )
    for ax, dim in zip(axes[0], dims):
        groups = layout.world_size // getattr(layout, dim)
        # one of tab20's 20 colours per group (neighbouring groups always differ; more than 20 groups repeat them)
        grid = [
            [group_of(n * hw.devices_per_node + d, layout, dim) % 20 for d in range(hw.devices_per_node)]
            for n in range(nodes)
        ]
        ax.imshow(grid, cmap="tab20", vmin=-0.5, vmax=19.5, aspect="auto", interpolation="nearest")
        repeat = ", colours repeat" if groups > 20 else ""
        ax.set_title(f"{dim}={getattr(layout, dim)}: {groups} groups\n(same colour: one group{repeat})", fontsize=9)
        ax.set_xlabel("device in node")
        ax.set_ylabel("node")
        if nodes * hw.devices_per_node <= 128:
            for n in range(nodes):
                for d in range(hw.devices_per_node):
                    ax.text(d, n, str(n * hw.devices_per_node + d), ha="center", va="center", fontsize=6)
    shown = "" if nodes == hw.nodes else f" (first {nodes} of {hw.nodes} nodes)"
    fig.suptitle(f"mesh on {hw.nodes} nodes x {hw.devices_per_node} devices{shown}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


COMPONENTS = ("params", "grads", "optimizer", "activations", "buffers")


def plot_memory(candidates: list[Candidate], hw: Hardware, path: str | Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(candidates), 4.5))
    labels = [c.name().replace(", ", "\n") for c in candidates]
    bottom = [0.0] * len(candidates)
    for comp in COMPONENTS:
        values = [c.memory[comp] / GIB for c in candidates]
        ax.bar(labels, values, bottom=bottom, label=comp)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(hw.usable_bytes / GIB, color="black", linestyle="--", label="usable (memory - reserve)")
    ax.set_ylabel("GiB per rank (worst stage)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("per-rank memory of the best layouts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
