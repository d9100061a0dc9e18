"""Mesh degrees -> validation -> one N-D DeviceMesh with named views.

Dims, outermost to innermost: pp, dp_replicate, dp_shard, cp, tp (tp innermost: the fastest links).
Named flattened views: dp = dp_replicate x dp_shard (data loading), dp_shard_cp = dp_shard x cp (FSDP
shards over it), dp_cp = dp x cp (loss and metric reduction). Expert parallel adds no dim: ep borrows the
innermost ranks of dp_shard x cp, and expert_dp = (dp_replicate, dp_shard x cp / ep) shards the expert
weights. Size-1 dims cost nothing.

The degrees are a unit of their own (lit_mesh/unit.py): their options (MeshDegrees) and their rules (RULES: the
degrees alone, then against the world size) live here, so this module imports nothing of lit-mesh but
lit_mesh.errors and lit_mesh.unit.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Literal, Optional, Union
from unittest import mock

import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh_module
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lit_mesh.errors import MeshConfigError, WorldSizeError  # noqa: F401 - re-exported (lit_mesh.mesh.MeshConfigError)
from lit_mesh.unit import Facts, Rule, divisors, enforce, option

Degree = Union[int, Literal["auto"], None]
AUTO_DEGREES = ("dp", "dp_shard", "tp")  # the degrees that may be "auto"


class MeshAxis:
    """The names of the mesh's axes and of its flattened views (torchtitan's MeshAxisName). Code names mesh
    axes by these, never by position; "dim" always means a tensor dim."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    # flattened views
    DP = "dp"  # dp_replicate x dp_shard: data loading
    DP_SHARD_CP = "dp_shard_cp"  # dp_shard x cp: FSDP shards over it
    DP_CP = "dp_cp"  # dp x cp: loss and metric reduction
    EP = "ep"  # experts are split over it (innermost ranks of dp_shard x cp)
    EDP_REPLICATE = "edp_replicate"  # expert weights: replicated over it...
    EFSDP = "efsdp"  # ...and FSDP-sharded over it
    # expert_tp=1 (MoE parallel folding: each tp rank routes its own sequence shard to whole experts)
    DP_CP_TP = "dp_cp_tp"  # dp x cp x tp: every rank routes different tokens, the load is summed over all
    EFSDP_TP = "efsdp_tp"  # dp_shard x cp x tp / ep: the whole experts are FSDP-sharded over it


MESH_AXES = (MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP, MeshAxis.TP)  # outermost first
# the axes each flattened view spans, in mesh order
VIEW_AXES: dict[str, tuple[str, ...]] = {
    MeshAxis.DP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD),
    MeshAxis.DP_SHARD_CP: (MeshAxis.DP_SHARD, MeshAxis.CP),
    MeshAxis.DP_CP: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP),
}
# Lightning ModelParallelStrategy's dim names, answered by the same mesh as views of dp and tp (any layout)
LIGHTNING_ALIASES = {"data_parallel": (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD), "tensor_parallel": (MeshAxis.TP,)}


@dataclass(frozen=True)
class MeshLayout:
    """Resolved degrees of every mesh dim; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel(self) -> Literal["none", "ddp", "fsdp", "hsdp"]:
        shard = self.dp_shard * self.cp
        if self.dp_replicate > 1:
            return "hsdp" if shard > 1 else "ddp"
        return "fsdp" if shard > 1 else "none"

    def describe(self) -> str:
        degrees = " x ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name != "ep")
        experts = f"; ep={self.ep} borrowed from dp_shard x cp" if self.ep > 1 else ""
        return f"{degrees} (world size {self.world_size}; data parallel: {self.data_parallel}{experts})"


def check_degree(name: str, value: Degree, allow_auto: bool = False) -> None:
    """Type and range of one degree, checked in MeshStrategy.__init__ (before any process exists)."""
    if value is None or (allow_auto and value == "auto"):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = "a positive int or 'auto'" if allow_auto else "a positive int"
        raise MeshConfigError(f"{name}={value!r} must be {allowed}")
    if value < 1:
        raise MeshConfigError(f"{name}={value} must be >= 1 (1 means the dim is not parallelised)")


def check_degrees(**degrees: Degree) -> None:
    """Everything that can be checked without knowing the world size."""
    for name, value in degrees.items():
        check_degree(name, value, allow_auto=name in AUTO_DEGREES)
    enforce(ONE_AUTO_DEGREE, Facts(degrees=degrees))


@dataclass(frozen=True)
class MeshDegrees:
    """The mesh: degrees as given (resolved against the world size by resolve_layout)."""

    dp: Degree = option(
        None, doc='data-parallel degree; alone it means FSDP over dp ranks. "auto" fills the world size.'
    )
    dp_replicate: Optional[int] = option(None, doc="replicas (DDP); with dp_shard > 1 as well, HSDP.")
    dp_shard: Degree = option(
        None, doc='FSDP shards per replica; "auto" fills the world size (the default when no dp degree is given).'
    )
    tp: Union[int, Literal["auto"]] = option(
        1, doc='tensor-parallel degree (innermost axis: keep it inside a node); "auto": the devices of a node.'
    )
    cp: int = option(
        1,
        doc="context-parallel degree: each sample's sequence is split over cp ranks (needs a plan that declares its"
        " attention and positions); FSDP then shards over dp_shard x cp.",
    )
    pp: int = option(
        1,
        doc="pipeline-parallel degree (outermost axis: stages may span nodes). The LightningModule computes its loss"
        " with `lit_mesh.loss_of(self.model, loss_fn, inputs, targets)` (and its outputs with `output_of`).",
    )
    ep: int = option(
        1,
        doc="expert-parallel degree, borrowed from dp_shard x cp (it adds no ranks): experts of the plan's MoE layers"
        " are split over ep, their weights FSDP-sharded over dp_shard x cp / ep.",
    )
    # None: on with tp_mode="1d", off otherwise (lit_mesh.options.MeshOptions resolves it: it reads tp_mode)
    sequence_parallel: Optional[bool] = option(
        None,
        doc="shard activations over the sequence between TP regions (needs tp to divide it); default: on with"
        ' tp_mode="1d", off otherwise.',
    )
    data_parallel_size: Degree = option(
        None,
        doc="ModelParallelStrategy's name, with its meaning: 'auto' (the default when only tensor_parallel_size is"
        " given) is the number of nodes; not together with dp or tp. The mesh answers to 'data_parallel' whichever"
        " names are used.",
    )
    tensor_parallel_size: Degree = option(
        None,
        doc="ModelParallelStrategy's name, with its meaning: 'auto' (the default when only data_parallel_size is"
        " given) is the devices per node; not together with dp or tp. The mesh answers to 'tensor_parallel'"
        " whichever names are used.",
    )

    def __post_init__(self) -> None:
        check_degrees(**self.degrees())
        check_degree("data_parallel_size", self.data_parallel_size, allow_auto=True)
        check_degree("tensor_parallel_size", self.tensor_parallel_size, allow_auto=True)

    def degrees(self) -> dict[str, Any]:
        return dict(
            dp=self.dp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
            ep=self.ep,
        )


def _lightning_sizes_given(f: Facts) -> bool:
    mesh = f.options.mesh
    return mesh.data_parallel_size is not None or mesh.tensor_parallel_size is not None


def _own_degrees(f: Facts) -> dict[str, Any]:
    """The degrees of MeshStrategy's own names that were given (not left at None or 1)."""
    return {name: value for name, value in f.degrees.items() if value not in (None, 1)}


def _model_parallel(f: Facts) -> int:
    return f.degrees["pp"] * f.degrees["cp"] * f.degrees["tp"]


def _world_size(f: Facts) -> int:
    assert f.world_size is not None, "the layout phase knows the world size"
    return f.world_size


ONE_AUTO_DEGREE = Rule(
    "one_auto_degree",
    "init",
    lambda f: f.degrees.get("dp") == "auto" and f.degrees.get("dp_shard") == "auto",
    lambda f: "dp='auto' and dp_shard='auto': only one degree may be 'auto'; give the other a number",
)

RULES: list[Rule] = [
    # ---- init: the degrees alone ---------------------------------------------------------------------------------
    ONE_AUTO_DEGREE,
    Rule(
        "lightning_sizes_alone",
        "init",
        lambda f: _lightning_sizes_given(f) and bool(_own_degrees(f)),
        lambda f: (
            "data_parallel_size/tensor_parallel_size (ModelParallelStrategy's names) together with"
            f" {', '.join(f'{name}={value!r}' for name, value in _own_degrees(f).items())}: give either the two Lightning"
            " sizes, or MeshStrategy's degrees (dp, dp_replicate, dp_shard, tp, cp, pp)"
        ),
    ),
    # ---- layout: the degrees against the world size --------------------------------------------------------------
    Rule(
        "model_parallel_divides_world",
        "layout",
        lambda f: _world_size(f) % _model_parallel(f) != 0,
        lambda f: (
            f"pp={f.degrees['pp']} x cp={f.degrees['cp']} x tp={f.degrees['tp']} = {_model_parallel(f)} does"
            f" not divide the world size {f.world_size} (devices x num_nodes); choose degrees whose product divides"
            f" {f.world_size}, e.g. tp in {divisors(_world_size(f))}"
        ),
        WorldSizeError,
    ),
    Rule(
        # whole experts under tp (expert_tp=1) may borrow tp ranks too: the launch rule "ep_needs_whole_experts"
        # (lit_mesh/parallel/expert.py) asks for dp_shard x cp alone otherwise
        "ep_divides_dp_shard_cp",
        "layout",
        lambda f: f.layout is not None and (f.layout.dp_shard * f.layout.cp * f.layout.tp) % f.layout.ep != 0,
        lambda f: ep_borrowing_problem(f.layout),
    ),
]


def ep_borrowing_problem(layout: MeshLayout) -> str:
    """Why `layout`'s ep cannot borrow its ranks, with the choices (whole experts under tp: tp ranks too)."""
    shard = layout.dp_shard * layout.cp
    whole = (
        f", or with expert_tp=1 (whole experts under tp, whose ep borrows tp ranks too) in {divisors(shard * layout.tp)}"
        if layout.tp > 1
        else ""
    )
    return (
        f"ep={layout.ep} does not divide dp_shard x cp = {layout.dp_shard} x {layout.cp} = {shard} (expert parallel"
        f" borrows its ranks from them, it does not add any); choose ep in {divisors(shard)}{whole}"
    )


_BY_NAME = {rule.name: rule for rule in RULES}


def resolve_layout(
    world_size: int,
    *,
    dp: Degree = None,
    dp_replicate: int | None = None,
    dp_shard: Degree = None,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
) -> MeshLayout:
    """Turn the user's degrees into a MeshLayout for `world_size` processes, or raise MeshConfigError.

    `dp` alone shards (FSDP); `dp_replicate` replicates (DDP); both > 1 is HSDP. With no dp degree given,
    dp_shard fills the world ("auto").
    """
    check_degrees(dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, pp=pp, ep=ep)
    given = f"pp={pp}, cp={cp}, tp={tp}" + "".join(
        f", {n}={v!r}" for n, v in (("dp", dp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard)) if v is not None
    )

    if tp == "auto":
        raise MeshConfigError("tp='auto' means the devices per node: resolve it with per_node_degrees() first")
    facts = Facts(
        degrees=dict(dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, pp=pp, ep=ep),
        world_size=world_size,
    )
    enforce(_BY_NAME["model_parallel_divides_world"], facts)  # a WorldSizeError, as ModelParallelStrategy raises
    model_parallel = pp * cp * tp
    dp_total = world_size // model_parallel  # what the data-parallel dims must fill

    if dp is None and dp_shard is None:
        dp_shard = "auto"
    if dp is not None:
        if dp == "auto":
            dp = dp_total
        if dp_replicate is None and dp_shard in (None, "auto"):
            dp_replicate, dp_shard = 1, dp
        elif dp_replicate is None:
            assert isinstance(dp_shard, int)
            if dp % dp_shard:
                raise MeshConfigError(f"dp_shard={dp_shard} does not divide dp={dp}; choose dp_shard in {divisors(dp)}")
            dp_replicate = dp // dp_shard
        elif dp_shard in (None, "auto"):
            if dp % dp_replicate:
                raise MeshConfigError(
                    f"dp_replicate={dp_replicate} does not divide dp={dp}; choose dp_replicate in {divisors(dp)}"
                )
            dp_shard = dp // dp_replicate
        elif dp_replicate * dp_shard != dp:
            raise MeshConfigError(
                f"dp_replicate={dp_replicate} x dp_shard={dp_shard} = {dp_replicate * dp_shard} but dp={dp};"
                " give dp alone, or dp_replicate and dp_shard whose product is dp"
            )
    dp_replicate = 1 if dp_replicate is None else dp_replicate
    if dp_shard == "auto":
        if dp_total % dp_replicate:
            raise MeshConfigError(
                f"dp_replicate={dp_replicate} does not divide the {dp_total} ranks left for data parallelism"
                f" (world size {world_size} / (pp x cp x tp = {model_parallel})); choose dp_replicate in"
                f" {divisors(dp_total)}"
            )
        dp_shard = dp_total // dp_replicate
    assert isinstance(dp_shard, int)

    layout = MeshLayout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
    if layout.world_size != world_size:
        raise WorldSizeError(
            f"{given}: pp x dp_replicate x dp_shard x cp x tp = {pp} x {dp_replicate} x {dp_shard} x {cp} x {tp}"
            f" = {layout.world_size}, but the world size (devices x num_nodes) is {world_size} (the degrees"
            f" multiplied should equal the world size); choose degrees whose product is {world_size}, or set"
            " dp='auto' to fill it"
        )
    facts.layout = layout
    enforce(_BY_NAME["ep_divides_dp_shard_cp"], facts)
    return layout


@dataclass(frozen=True)
class LightningSizes:
    """ModelParallelStrategy's `data_parallel_size` / `tensor_parallel_size`, with its meaning of "auto":
    data parallel over the nodes, tensor parallel over the devices of a node."""

    data_parallel: Union[int, Literal["auto"]] = "auto"
    tensor_parallel: Union[int, Literal["auto"]] = "auto"

    def degrees(self, nodes: int, devices_per_node: int) -> dict[str, int]:
        dp = nodes if self.data_parallel == "auto" else self.data_parallel
        tp = devices_per_node if self.tensor_parallel == "auto" else self.tensor_parallel
        assert isinstance(dp, int) and isinstance(tp, int)
        world_size = nodes * devices_per_node
        if dp * tp != world_size:
            raise WorldSizeError(
                f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}: the sizes multiplied should equal"
                f" the world size {world_size} (num_nodes={nodes} x devices={devices_per_node}); choose sizes whose"
                f" product is {world_size}, or 'auto' (data parallel = nodes, tensor parallel = devices per node)"
            )
        return {"dp": dp, "tp": tp}


def lightning_sizes(data_parallel_size: Degree, tensor_parallel_size: Degree) -> Optional[LightningSizes]:
    """The Lightning-named sizes, if given (either one given means the other defaults to "auto", as in
    ModelParallelStrategy). Not together with our own dp/tp names: the rule "lightning_sizes_alone"."""
    if data_parallel_size is None and tensor_parallel_size is None:
        return None
    sizes = LightningSizes(
        "auto" if data_parallel_size is None else data_parallel_size,
        "auto" if tensor_parallel_size is None else tensor_parallel_size,
    )
    check_degree("data_parallel_size", sizes.data_parallel, allow_auto=True)
    check_degree("tensor_parallel_size", sizes.tensor_parallel, allow_auto=True)
    return sizes


def per_node_degrees(
    degrees: dict[str, Any], sizes: Optional[LightningSizes], nodes: int, devices_per_node: int
) -> dict[str, Any]:
    """Degrees for resolve_layout once nodes and devices are known: Lightning's sizes, and tp="auto" = the
    devices of a node (ModelParallelStrategy's meaning: tensor parallel inside a node)."""
    resolved = dict(degrees)
    if sizes is not None:
        resolved.update(sizes.degrees(nodes, devices_per_node))
    if resolved.get("tp") == "auto":
        resolved["tp"] = devices_per_node
    return resolved


@dataclass(frozen=True)
class MeshViews:
    """The root mesh and the flattened views every technique reads (kept here: torch deprecates slicing
    flattened dims back out of the root mesh)."""

    root: DeviceMesh
    dp: DeviceMesh  # dp_replicate x dp_shard: data loading
    dp_shard_cp: DeviceMesh  # FSDP shards over it
    dp_cp: DeviceMesh  # loss and metric reduction
    hsdp: DeviceMesh  # 2D (dp_replicate, dp_shard_cp): FSDP2's replicate-and-shard mesh
    ep: DeviceMesh  # experts are split over it (innermost ranks of dp_shard x cp)
    expert_dp: DeviceMesh  # expert weights are FSDP-sharded over what remains: (edp_replicate, efsdp)
    layout: MeshLayout  # the degrees the mesh was built from
    # views made on first use (folded_expert_meshes), kept with these views: a DeviceMesh compares by its layout, so a
    # cache keyed by the root would hand a later world of the same shape this world's groups
    made_later: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __getitem__(self, name: str) -> DeviceMesh:
        view = getattr(self, name, None)
        return view if isinstance(view, DeviceMesh) else self.root[name]

    def axes_of(self, name: str) -> tuple[str, ...]:
        """The root mesh's axes that the axis or view `name` spans."""
        return VIEW_AXES.get(name, (name,))


class GroupPool:
    """The process groups of one mesh, by their members: every group carries the run's timeout (torch gives a group
    made without one its own default, 10 min on NCCL and 30 on gloo, whatever the world's), and ranks that several
    dims or views share (dp_shard, dp, dp_shard_cp, dp_cp, data_parallel on a dp_shard x tp layout) get one
    communicator. A collective like torch's new_group: every rank asks for the same groups in the same order, so
    every rank skips a set of members it already made at the same call."""

    def __init__(self, timeout: Optional[timedelta]) -> None:
        self.timeout = timeout
        self._groups: dict[tuple, Any] = {}

    def new_group(
        self, ranks: Optional[Sequence[int]] = None, timeout: Optional[timedelta] = None, **kwargs: Any
    ) -> Any:
        """torch's new_group, once per (backend, members); NON_GROUP_MEMBER on a rank outside `ranks`."""
        members = tuple(sorted(ranks if ranks is not None else range(dist.get_world_size())))
        key = ("new_group", kwargs.get("backend"), members)
        if key not in self._groups:
            self._groups[key] = dist.new_group(ranks=list(members), timeout=timeout or self.timeout, **kwargs)
        return self._groups[key]

    def split_group(
        self,
        parent_pg: Any = None,
        split_ranks: Optional[list] = None,
        timeout: Optional[timedelta] = None,
        **kwargs: Any,
    ) -> Any:
        """torch's split_group (NCCL with the world bound to a device: one ncclCommSplit per partition), once per
        partition of the ranks."""
        assert split_ranks is not None  # DeviceMesh always passes the partition
        key = ("split_group", tuple(sorted(tuple(sorted(ranks)) for ranks in split_ranks)))
        if key not in self._groups:
            self._groups[key] = dist.split_group(
                parent_pg=parent_pg, split_ranks=split_ranks, timeout=timeout or self.timeout, **kwargs
            )
        return self._groups[key]

    def group_of_rank(self, partition: Sequence[Sequence[int]]) -> Any:
        """The group of this rank among `partition` (every rank in exactly one part; new_subgroups_by_enumeration)."""
        mine = None
        for ranks in partition:
            group = self.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    @contextmanager
    def making(self) -> Iterator[None]:
        """While DeviceMesh makes groups (init_device_mesh, _flatten, _unflatten): through this pool. torch's mesh
        has no argument for either a timeout that fits every backend or sharing groups between dims, so its module's
        two group makers are replaced for the duration (single-threaded: the mesh is built at setup)."""
        with (
            mock.patch.object(device_mesh_module, "new_group", self.new_group),
            mock.patch.object(device_mesh_module, "split_group", self.split_group),
        ):
            yield


_POOLS: weakref.WeakKeyDictionary[DeviceMesh, GroupPool] = weakref.WeakKeyDictionary()


def group_pool(root: DeviceMesh) -> GroupPool:
    """The pool of the root mesh `root` (any later groups over its ranks go through it: TP grids, the hierarchical
    all-reduce); a mesh not made by build_device_mesh gets a pool of its own with torch's default timeout."""
    root = root._get_root_mesh()
    if root not in _POOLS:
        _POOLS[root] = GroupPool(None)
    return _POOLS[root]


def build_device_mesh(layout: MeshLayout, device_type: str, timeout: Optional[timedelta] = None) -> MeshViews:
    """The one DeviceMesh of the run, with the flattened views dp, dp_shard_cp, dp_cp and hsdp; every group with
    `timeout` (None: torch's default) and one group per set of members (GroupPool)."""
    pool = GroupPool(timeout)
    with pool.making():
        views = _build_views(layout, device_type)
    _POOLS[views.root] = pool
    return views


def _build_views(layout: MeshLayout, device_type: str) -> MeshViews:
    A = MeshAxis
    shape = tuple(getattr(layout, axis) for axis in MESH_AXES)
    root = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
    flatten = lambda view: root[VIEW_AXES[view]]._flatten(view)  # noqa: E731
    dp_cp = flatten(A.DP_CP)
    for alias, axes in LIGHTNING_ALIASES.items():  # root["data_parallel"] / root["tensor_parallel"] answer
        root[axes]._flatten(alias)
    # ep borrows the innermost ranks of dp_shard x cp; the expert weights are sharded over the rest. An ep that takes
    # tp ranks too (whole experts under tp: folded_expert_meshes) leaves these views at ep 1, unused
    ep = layout.ep if (layout.dp_shard * layout.cp) % layout.ep == 0 else 1
    expert_shards = layout.dp_shard * layout.cp // ep
    experts = dp_cp._unflatten(0, (layout.dp_replicate, expert_shards, ep), (A.EDP_REPLICATE, A.EFSDP, A.EP))
    return MeshViews(
        root=root,
        dp=flatten(A.DP),
        dp_shard_cp=flatten(A.DP_SHARD_CP),
        dp_cp=dp_cp,
        # dp_cp is ordered replicate-major, so unflattening it gives the (replicate, shard) grid
        hsdp=dp_cp._unflatten(0, (layout.dp_replicate, layout.dp_shard * layout.cp), (A.DP_REPLICATE, A.DP_SHARD_CP)),
        ep=experts[A.EP],
        expert_dp=experts[A.EDP_REPLICATE, A.EFSDP],
        layout=layout,
    )


@dataclass(frozen=True)
class FoldedExpertMeshes:
    """The meshes of whole experts under tp (expert_tp=1): every rank of dp x cp x tp routes its own tokens, so the load
    sums over all of them, ep takes the innermost of those ranks (a tp group first: Megatron-Core's folding) and the
    expert weights are FSDP-sharded over the rest."""

    dp_cp_tp: DeviceMesh  # 1-D: the load statistics
    ep: DeviceMesh  # the innermost ep ranks of dp x cp x tp
    expert_dp: DeviceMesh  # FSDP2's mesh: efsdp, or (edp_replicate, efsdp) where dp_replicate > 1


def folded_expert_meshes(views: MeshViews) -> FoldedExpertMeshes:
    """Made on first use, once per mesh (only runs with expert_tp=1 need their groups), through the mesh's pool."""
    if "folded_experts" not in views.made_later:
        A, layout = MeshAxis, views.layout
        with group_pool(views.root).making():
            dp_cp_tp = views.root[VIEW_AXES[A.DP_CP] + (A.TP,)]._flatten(A.DP_CP_TP)
            expert_shards = layout.dp_shard * layout.cp * layout.tp // layout.ep
            grid = dp_cp_tp._unflatten(
                0, (layout.dp_replicate, expert_shards, layout.ep), (A.EDP_REPLICATE, A.EFSDP_TP, A.EP)
            )
        expert_dp = grid[A.EFSDP_TP] if layout.dp_replicate == 1 else grid[A.EDP_REPLICATE, A.EFSDP_TP]
        views.made_later["folded_experts"] = FoldedExpertMeshes(dp_cp_tp, grid[A.EP], expert_dp)
    return views.made_later["folded_experts"]
