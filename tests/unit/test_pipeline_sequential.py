"""A plain nn.Sequential pipelined without a plan, on one process: which nn.Sequential is cut, the cut balanced by
parameter count (the smallest largest stage, checked against every possible cut), and the stages it makes chain to
the whole network under its own parameter names. Training on 4 ranks: tests/integration/test_examples.py."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lit_mesh.errors import PipelineConfigError, PlanError
from lit_mesh.parallel.pipeline.sequential import SEQUENTIAL_PLAN, sequential_owners
from lit_mesh.parallel.pipeline.split import parameter_balanced_split, split_into_stages, stage_ranks
from lit_mesh.parallel.tensor import tp_plan_problem
from lit_mesh.rules import check
from lit_mesh.unit import Facts


def conv_net() -> nn.Sequential:
    """examples/pipeline_sequential.py's network: four convolution stages and a classifier (14 children)."""
    layers: list[nn.Module] = []
    for c_in in (3, 16, 16, 16):
        layers += [nn.Conv2d(c_in, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(16, 10))


def sizes_of(net: nn.Sequential) -> list[int]:
    return [sum(p.numel() for p in child.parameters()) for child in net]


def test_the_textbook_network_gets_one_convolution_stage_per_rank() -> None:
    assert parameter_balanced_split(sizes_of(conv_net()), 4) == [3, 3, 3, 5]  # conv, relu, pool | ... | + head
    assert parameter_balanced_split(sizes_of(conv_net()), 2) == [6, 8]


def test_parameter_free_children_stay_with_the_child_before_them() -> None:
    assert parameter_balanced_split([0, 0, 5, 0, 5, 0], 2) == [4, 2]  # leading ones join the first stage
    assert parameter_balanced_split([10, 0, 0, 1, 1, 8], 3) == [3, 2, 1]


def _best_largest_stage(sizes: list[int], n_stages: int) -> int:
    """Brute force: the smallest largest stage over every cut that starts each stage at a child with parameters
    (every stage holds one: the first begins at the first child and takes the first child with parameters)."""
    starts = [i for i in range(len(sizes)) if sizes[i] > 0][1:]
    best = None
    for cut in itertools.combinations(starts, n_stages - 1):
        bounds = [0, *cut, len(sizes)]
        largest = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = largest if best is None else min(best, largest)
    assert best is not None
    return best


def test_the_cut_makes_the_largest_stage_as_small_as_any_cut_can() -> None:
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 0, 1, 3, 7, 20, 100]) for _ in range(rng.randint(2, 9))]
        sizes[rng.randrange(len(sizes))] = 5  # at least one child with parameters
        n_units = sum(1 for s in sizes if s > 0)
        for n_stages in range(1, n_units + 1):
            split = parameter_balanced_split(sizes, n_stages)
            assert len(split) == n_stages and sum(split) == len(sizes) and min(split) >= 1, (sizes, split)
            bounds = [sum(split[:s]) for s in range(n_stages + 1)]
            assert all(sizes[b] > 0 for b in bounds[1:-1]), (sizes, split)  # stages begin at parameters
            largest = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
            assert largest == _best_largest_stage(sizes, n_stages), (sizes, n_stages, split)


def test_more_stages_than_children_with_parameters_is_refused_with_the_fix() -> None:
    with pytest.raises(PipelineConfigError, match=r"8 pipeline stages but the model has 5 block\(s\) with parameters"):
        parameter_balanced_split(sizes_of(conv_net()), 8)


class Holder(LightningModule):
    def __init__(self, *nets: nn.Module) -> None:
        super().__init__()
        self.nets = nn.ModuleList(nets)


def test_the_outermost_sequential_with_parameters_is_the_one_cut() -> None:
    net = conv_net()
    owners = sequential_owners(Holder(nn.Sequential(nn.ReLU()), net))
    assert [(o.name, o.module, o.plan) for o in owners] == [("nets.1", net, SEQUENTIAL_PLAN)]
    assert len(sequential_owners(Holder(conv_net(), conv_net()))) == 2  # pp refuses two (pp_needs_one_plan)
    assert tp_plan_problem(SEQUENTIAL_PLAN, 2, "Holder") == (
        "tp=2: an nn.Sequential pipelined without a plan has no tensor-parallel plan; declare parallel_plan() with a"
        " TensorPlan on the network (see examples/own_model_plan.py), or use tp=1"
    )


@pytest.mark.parametrize(("pp", "placement"), [(4, "loop"), (2, "loop"), (2, "v")])
def test_the_stages_chain_to_the_whole_network_under_its_names(pp: int, placement: str) -> None:
    torch.manual_seed(0)
    whole = conv_net()
    images = torch.randn(2, 3, 16, 16)
    expected = whole(images)
    names = {n for n, _ in whole.named_parameters()}
    split = parameter_balanced_split(sizes_of(whole), 4)  # 4 stages: one per rank, or two per rank
    ranks = stage_ranks(4, pp, placement)  # type: ignore[arg-type]
    stages, held = [], set()
    for rank in range(pp):
        model = conv_net()
        model.load_state_dict(whole.state_dict())
        stages += split_into_stages(model, SEQUENTIAL_PLAN, split, ranks, rank)
        held |= {n for n, _ in model.named_parameters()}  # what each rank's optimizer and checkpoint see
    assert held == names
    x = images
    for stage in sorted(stages, key=lambda s: s.index):
        x = stage.module(x)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


class OwnTransformer(LightningModule):
    """A user's model without a plan whose repeated blocks sit in an nn.ModuleList (each with an nn.Sequential MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(4, 8)


def _setup_facts(root: LightningModule, pp: int) -> Facts:
    from lit_mesh.mesh import MeshLayout
    from lit_mesh.options import MeshOptions

    layout = MeshLayout(pp=pp, dp_shard=1)
    return Facts(
        options=MeshOptions(),
        layout=layout,
        model_name=type(root).__name__,
        root=root,
        owners=sequential_owners(root) if pp > 1 else [],
    )


def test_a_model_without_plan_and_without_one_sequential_is_refused_under_pp_with_the_fixes() -> None:
    """Its layers are three nn.Sequential blocks in a ModuleList and an embedding and head outside: cutting one of
    them (or refusing with their names as 'plans') would be wrong; the error names what lies outside and the fixes."""
    model = OwnTransformer()
    with pytest.raises(PlanError) as refused:
        check("setup", _setup_facts(model, pp=2))
    message = str(refused.value)
    assert message.startswith(
        "pp=2: OwnTransformer declares no parallel_plan(), and without one only a network held as one nn.Sequential"
        " is cut into pipeline stages (by its children); embedding.weight, head.weight, head.bias lie outside any"
        " nn.Sequential"
    ), message
    assert "(its repeated blocks: layers.0-2 (Sequential))" in message
    for fix in ("PipelinePlan", "one nn.Sequential and compute the loss with lit_mesh.loss_of", "pp=1"):
        assert fix in message
    check("setup", _setup_facts(model, pp=1))  # without pp: FSDP units per block, nothing to cut


def test_a_sequential_beside_other_parameters_is_refused_under_pp() -> None:
    """One nn.Sequential holding the blocks, a parameter beside it: the stages would never see that parameter."""
    holder = Holder(conv_net(), nn.Linear(2, 2))
    with pytest.raises(PlanError, match=r"nets\.1\.weight, nets\.1\.bias lie outside any nn\.Sequential"):
        check("setup", _setup_facts(holder, pp=2))
    check("setup", _setup_facts(Holder(conv_net()), pp=2))  # the network alone: cut by its children
