"""The parameters of a zoo GPT by role, read from a one-block model on the meta device and its ParallelPlan
(the TP style of each module is the plan's, so the planner shards exactly what lit_mesh.parallel shards)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from zoo.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    tp_style: str | None  # the plan's style of the module holding it (None: replicated over tp)
    is_embedding: bool  # an nn.Embedding weight (RowwiseParallel shards its rows, a Linear's columns)


@dataclass(frozen=True)
class ModelShapes:
    config: GPTConfig
    block: tuple[ParamShape, ...]  # one block's parameters; every block has the same
    first: tuple[ParamShape, ...]  # before the blocks (the first pipeline stage holds them)
    last: tuple[ParamShape, ...]  # after the blocks (the last stage)
    tp_divides: dict[str, int]

    @property
    def n_blocks(self) -> int:
        return self.config.n_layers

    def numel(self) -> int:
        count = lambda params: sum(_numel(p.shape) for p in params)  # noqa: E731
        return count(self.first) + count(self.last) + self.n_blocks * count(self.block)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gpt_shapes(config: GPTConfig) -> ModelShapes:
    with torch.device("meta"):
        model = GPT(dataclasses.replace(config, n_layers=1))
    plan = model.parallel_plan()
    modules = dict(model.named_modules())
    block, first, last = [], [], []
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        embedding = isinstance(modules[owner], torch.nn.Embedding)
        if name.startswith(f"{plan.blocks}.0."):
            local = owner[len(plan.blocks) + 3 :]
            block.append(ParamShape(name[len(plan.blocks) + 3 :], tuple(p.shape), plan.tp_block.get(local), embedding))
            continue
        child = name.split(".")[0]
        entry = ParamShape(name, tuple(p.shape), plan.tp_root.get(owner), embedding)
        if child in plan.pp_first:
            first.append(entry)
        elif child in plan.pp_last:
            last.append(entry)
        else:
            raise ValueError(f"{name}: neither in a block nor in the plan's pp_first / pp_last")
    return ModelShapes(config, tuple(block), tuple(first), tuple(last), dict(plan.tp_divides))
