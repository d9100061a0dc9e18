"""Expert tensor parallel on torch's fake process group (one process): the expert weights' placements and each
rank's local shapes after lit-mesh's own `parallelize`, and Mixtral's packed [gate; up] split (lit_mesh/parallel/expert.py).
Numerics across ranks: tests/integration/test_moe_parity.py (tp2, tp2 x ep2) and tests/integration/test_hf.py (Mixtral)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_mesh.checkpoint.pretrained import local_index
from lit_mesh.mesh import MeshLayout, build_device_mesh
from lit_mesh.options import ExpertOptions, MeshDegrees, MeshOptions
from lit_mesh.parallel.apply import parallelize
from lit_mesh.parallel.expert import expert_tp_placement
from lit_mesh.plan import MoEPlan, PlanError
from zoo.moe import MoEConfig, MoETransformer


@contextmanager
def fake_ranks(world_size: int, rank: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _experts_after_parallelize(layout: MeshLayout, rank: int, expert_tp: int | None = None) -> dict[str, DTensor]:
    """The expert weights of rank `rank` (and the router gate's weight, as "gate")."""
    with fake_ranks(layout.world_size, rank):
        root = nn.Module()
        with torch.device("meta"):
            root.model = MoETransformer(MoEConfig.from_preset("tiny"))  # 4 experts, (4, 64, 64) each weight
        options = MeshOptions(mesh=MeshDegrees(sequence_parallel=layout.tp > 1), expert=ExpertOptions(expert_tp))
        parallelize(root, build_device_mesh(layout, "cpu"), options, precision="32-true")
        moe = root.model.layers[0].moe
        return {**dict(moe.experts.named_parameters()), "gate": moe.router.gate.weight}


# layout -> weight -> ({mesh dim: placement}, local shape); w1/w3 (E, dim, hidden), w2 (E, hidden, dim)
EXPECTED = {
    "tp2": (
        MeshLayout(tp=2),
        {
            "w1": ({"ep": "S(0)", "tp": "S(2)"}, (4, 64, 32)),
            "w2": ({"ep": "S(0)", "tp": "S(1)"}, (4, 32, 64)),
        },
    ),
    # ep 2 x tp 2 x FSDP 2 beside ep: FSDP takes the dim tp leaves (dim 1 of w1/w3, dim 2 of w2)
    "fsdp4_tp2_ep2": (
        MeshLayout(dp_shard=4, tp=2, ep=2),
        {
            "w1": ({"efsdp": "S(1)", "ep": "S(0)", "tp": "S(2)"}, (2, 32, 32)),
            "w3": ({"efsdp": "S(1)", "ep": "S(0)", "tp": "S(2)"}, (2, 32, 32)),
            "w2": ({"efsdp": "S(2)", "ep": "S(0)", "tp": "S(1)"}, (2, 32, 32)),
        },
    ),
    "ep2_without_tp": (
        MeshLayout(dp_shard=2, ep=2),
        {"w1": ({"efsdp": "S(1)", "ep": "S(0)"}, (2, 64, 64))},
    ),  # efsdp: 1 rank
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_expert_weights_are_split_over_tp_by_hidden_unit(name: str) -> None:
    layout, expected = EXPECTED[name]
    for rank in (0, layout.world_size - 1):
        params = _experts_after_parallelize(layout, rank)
        for weight, (placements, local_shape) in expected.items():
            param = params[weight]
            assert isinstance(param, DTensor) and tuple(param.shape) == (4, 64, 64), (name, weight)
            assert dict(zip(param.device_mesh.mesh_dim_names, map(str, param.placements))) == placements, (
                name,
                weight,
                param.placements,
            )
            assert tuple(param.to_local().shape) == local_shape, (name, weight, rank)


# expert_tp=1 (whole experts under tp): ep takes the innermost ranks of dp_shard x cp x tp, FSDP the rest
EXPECTED_WHOLE = {
    "fsdp4_tp2_ep2": (
        MeshLayout(dp_shard=4, tp=2, ep=2),  # 8 ranks: efsdp_tp = 4 x 2 / 2 = 4 shards of dim 1
        {
            "w1": ({"efsdp_tp": "S(1)", "ep": "S(0)"}, (2, 16, 64)),
            "w2": ({"efsdp_tp": "S(1)", "ep": "S(0)"}, (2, 16, 64)),
            # the router's gate: replicated over tp (its gradient summed), FSDP-sharded over dp_shard as any block's
            "gate": ({"dp_shard_cp": "S(0)", "tp": "R"}, (1, 64)),
        },
    ),
    "tp2": (  # no data parallel: the whole experts FSDP-sharded over the tp pair alone (their gradients summed)
        MeshLayout(tp=2),
        {"w1": ({"efsdp_tp": "S(1)", "ep": "S(0)"}, (4, 32, 64)), "gate": ({"tp": "R"}, (4, 64))},
    ),
}


@pytest.mark.parametrize("name", list(EXPECTED_WHOLE))
def test_whole_experts_under_tp_are_split_over_ep_and_sharded_over_the_rest(name: str) -> None:
    layout, expected = EXPECTED_WHOLE[name]
    for rank in (0, layout.world_size - 1):
        params = _experts_after_parallelize(layout, rank, expert_tp=1)
        for weight, (placements, local_shape) in expected.items():
            param = params[weight]
            assert isinstance(param, DTensor), (name, weight)
            assert dict(zip(param.device_mesh.mesh_dim_names, map(str, param.placements))) == placements, (
                name,
                weight,
                param.placements,
            )
            assert tuple(param.to_local().shape) == local_shape, (name, weight, rank)


def test_packed_gate_up_gives_each_tp_rank_its_slice_of_both_halves() -> None:
    # Mixtral's gate_up_proj (E, 2I, D) = [gate; up] on dim 1: rank t must hold gate rows and up rows of slice t
    moe = MoEPlan(layer="mlp", hidden_dims={"gate_up_proj": 1, "down_proj": 2}, packed=("gate_up_proj",))
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)  # I = 4: gate rows 0-3, up rows 4-7
    for rank in (0, 1):
        with fake_ranks(2, rank):
            mesh = build_device_mesh(MeshLayout(tp=2), "cpu")["tp"]
            gate_up = distribute_tensor(full, mesh, [expert_tp_placement(moe, "gate_up_proj", "M")], src_data_rank=None)
            down = distribute_tensor(
                full.transpose(1, 2), mesh, [expert_tp_placement(moe, "down_proj", "M")], src_data_rank=None
            )
            read = local_index(gate_up)  # the rows a pretrained load reads for this rank
        rows = [2 * rank, 2 * rank + 1, 4 + 2 * rank, 5 + 2 * rank]
        assert torch.equal(gate_up.to_local(), full[:, rows]) and read[1].tolist() == rows, (rank, read)
        assert torch.equal(down.to_local(), full.transpose(1, 2)[:, :, 2 * rank * 2 : 2 * rank * 2 + 4]), rank


def test_an_expert_weight_without_a_hidden_dim_is_refused_by_name() -> None:
    moe = MoEPlan(layer="moe", hidden_dims={"w1": 2})
    with pytest.raises(
        PlanError, match=r"Net.parallel_plan\(\): expert weight 'w2' has no hidden dim in MoEPlan.hidden_dims"
    ):
        expert_tp_placement(moe, "w2", "Net")
